"""A byte-level tokenizer that needs no download: 3 special tokens + the 256 byte values."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

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
