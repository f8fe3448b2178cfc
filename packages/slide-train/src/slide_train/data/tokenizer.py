"""A byte-level tokenizer that needs no download: 3 special tokens + the 256 byte values."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from .config import DataError

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")

# A tiny chat template, enough to fine-tune and to test chat masking with the built-in tokenizer. The end of
# an assistant turn is `eos`, so a model trained on it learns to stop.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + eos_token + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def _byte_to_char() -> dict[int, str]:
    """Map each byte to a printable character, as byte-level BPE vocabularies spell bytes.

    Printable Latin-1 bytes stand for themselves; the others (controls, space) are moved to code points from
    256 up, so that no vocabulary entry is whitespace or invisible. This must match the ByteLevel
    pre-tokenizer's own mapping, which the test of this module checks by round-tripping every byte.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def builtin_tokenizer() -> PreTrainedTokenizerFast:
    """Ids 0-2 are <pad>, <bos>, <eos>; id 3 + b is byte b. Encoding adds no special tokens by itself."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b, ch in _byte_to_char().items():
        vocab[ch] = len(SPECIAL_TOKENS) + b
    # BPE with no merges is a pure byte tokenizer that HF knows how to save, load and decode.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


# Text a tokenizer with a vocabulary encodes into some ordinary token: one built without its vocabulary files
# gives nothing, or only its unknown token.
PROBE_TEXT = "The quick brown fox jumps over the lazy dog. 0123456789"


def check_tokenizer(tokenizer, fmt: str) -> None:
    """What data format `fmt` needs of the tokenizer: a vocabulary, and an EOS token for the formats that end each
    document or answer with one (text, jsonl, alpaca): without it a model never learns where one ends."""
    name = getattr(tokenizer, "name_or_path", "") or "the model"
    ids = list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])
    special = set(tokenizer.all_special_ids)
    if not any(t not in special for t in ids):
        got = " ".join(tokenizer.convert_ids_to_tokens(ids)) or "nothing"
        raise DataError(f"the tokenizer of {name} has no vocabulary ({len(tokenizer)} tokens; {PROBE_TEXT!r} "
                        f"encodes to {got}): its vocabulary file (tokenizer.json, tokenizer.model, or vocab.json "
                        "with merges.txt) is missing or empty; copy the model's tokenizer files next to its "
                        "config.json")
    if fmt in ("text", "jsonl", "alpaca") and tokenizer.eos_token_id is None:
        raise DataError(f"the tokenizer of {name} has no EOS token, which data.format={fmt} puts at the end of "
                        "each example so the model learns to stop: set eos_token in its tokenizer_config.json")
