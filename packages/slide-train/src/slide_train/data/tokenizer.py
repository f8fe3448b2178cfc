"""A byte-level tokenizer that needs no download (3 special tokens + the 256 byte values), and what a run needs of
a tokenizer: a vocabulary, an EOS token, and few unknown tokens on the run's own data."""

from __future__ import annotations

import unicodedata
import warnings
from collections import Counter
from dataclasses import dataclass, field

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ..errors import plural
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


def check_tokenizer(tokenizer, fmt: str) -> None:
    """What data format `fmt` needs of the tokenizer: a vocabulary, and an EOS token for the formats that end each
    document or answer with one (text, jsonl, alpaca): without it a model never learns where one ends. Whether
    the vocabulary fits the data is measured on the data itself (`unknown_share`)."""
    name = getattr(tokenizer, "name_or_path", "") or "the model"
    special = set(tokenizer.all_special_tokens)
    if all(token in special for token in tokenizer.get_vocab()):
        entries = " ".join(sorted(tokenizer.get_vocab(), key=tokenizer.get_vocab().get)) or "nothing"
        raise DataError(f"the tokenizer of {name} has no vocabulary (its {len(tokenizer)} tokens are all special: "
                        f"{entries}): its vocabulary file (tokenizer.json, tokenizer.model, or vocab.json with "
                        "merges.txt) is missing or empty; copy the model's tokenizer files next to its config.json")
    if fmt in ("text", "jsonl", "alpaca") and tokenizer.eos_token_id is None:
        raise DataError(f"the tokenizer of {name} has no EOS token, which data.format={fmt} puts at the end of "
                        "each example so the model learns to stop: set eos_token in its tokenizer_config.json")


UNKNOWN_SAMPLE = 1000  # the first examples of the data whose unknown tokens are counted
UNKNOWN_WARN, UNKNOWN_REFUSE = 0.05, 0.5  # shares of unknown tokens that warn, and that refuse the data
ROWS_SHOWN = 3  # the rows with the largest share, shown in the message


@dataclass
class UnknownShare:
    """How much of the data's first examples the tokenizer does not know: its unknown tokens, or, for a tokenizer
    without one, the characters that encoding then decoding loses (each counted as a token)."""

    unknown: int
    total: int  # tokens (special ones aside) plus the characters lost
    examples: int  # examples measured
    rows: list[str] = field(default_factory=list)  # the worst rows, each as where, count and a glimpse

    @property
    def share(self) -> float:
        return self.unknown / self.total if self.total else 0.0

    def text(self) -> str:
        """ "2.5% of the tokens of the first 1,000 examples" """
        return f"{self.share:.1%} of the tokens of the first {self.examples:,} example{'s' * (self.examples != 1)}"


def _characters(text: str) -> Counter:
    """The characters a tokenizer must give back, as a multiset: spacing, case and accents left out, which
    normalizers and decoders change without losing what was written."""
    text = unicodedata.normalize("NFKD", text).casefold()
    return Counter(c for c in text if not c.isspace() and unicodedata.category(c) != "Mn")


def _glimpse(text: str, n: int = 40) -> str:
    return repr(text[:n] + ("..." if len(text) > n else ""))


def unknown_share(tokenizer, samples: list[tuple[str, list[int], str]]) -> UnknownShare:
    """The unknown share of `samples` (text, the ids the tokenizer made of it, where it is)."""
    unk = tokenizer.unk_token_id
    special = set(tokenizer.all_special_ids) - {unk}
    unknown = total = 0
    worst = []
    for text, ids, where in samples:
        counted = sum(t not in special for t in ids)
        if unk is not None:
            missing = sum(t == unk for t in ids)
            shown = " ".join(tokenizer.convert_ids_to_tokens([t for t in ids if t not in special][:8]))
            line = f"{where}: {missing} of {plural(counted, 'token')} unknown, {_glimpse(text)} -> {shown}"
        else:  # unknown characters leave no token: they are missing from the decoded text
            decoded = tokenizer.decode(ids, skip_special_tokens=False)
            missing = sum((_characters(text) - _characters(decoded)).values())
            counted += missing
            line = f"{where}: {missing} characters lost, {_glimpse(text)} decodes to {_glimpse(decoded)}"
        unknown, total = unknown + missing, total + counted
        if missing:
            worst.append((-missing / counted, len(worst), line))
    return UnknownShare(unknown, total, len(samples), [line for *_, line in sorted(worst)[:ROWS_SHOWN]])


def judge_unknown(measured: UnknownShare, tokenizer, source, allow: bool) -> None:
    """Refuse data the tokenizer mostly does not know (unless `allow`), warn where a noticeable share is unknown."""
    if measured.share <= UNKNOWN_WARN:
        return
    name = getattr(tokenizer, "name_or_path", "") or "the model"
    what = f"{source}: {measured.text()} are unknown to the tokenizer of {name} ({'; '.join(measured.rows)})"
    if measured.share > UNKNOWN_REFUSE and not allow:
        raise DataError(f"{what}: this tokenizer does not fit the data; use the model's own tokenizer, or set "
                        "data.allow_unknown_tokens: true to train on it anyway")
    warnings.warn(f"{what}: is it the model's own tokenizer?", stacklevel=3)
