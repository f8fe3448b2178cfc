"""Turning records into token examples: ids, labels (-100 where no loss) and whether they may be split.

Records come from sources.py (any file type); chat and sharegpt rows become messages in conversations.py.

Truncation policy, per format:
- `text` / `jsonl`: a document is `[bos] + tokens + [eos]` (each only when the tokenizer has it). A document
  longer than seq_len is never cut off: packing splits it at row boundaries, and each part trains.
- `tokens`: rows are used exactly as given (no bos/eos added); a row longer than seq_len is split into
  seq_len chunks, each its own example.
- `alpaca` / `chat` / `sharegpt`: an example longer than seq_len is truncated to seq_len (its end is lost) and
  counted; build_data warns with the count.

An example left with no loss token (a conversation with no assistant turn, say) is dropped and counted, and its
row kept for the warning: rows lost that way often mean the wrong format or role names.

Every example's first label is -100: the loss shifts by one, so the first token of a document would be
predicted from the previous document's last token, which its attention cannot see once packed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import torch

from ..errors import plural
from ..progress import bar
from .config import DataConfig, DataError
from .conversations import SHAREGPT_ROLES, RoleMap, chat_messages, sharegpt_messages
from .corpus import builtin_corpus_path
from .sources import ROW_FILES, Record, Records, check_file, get_key, has_rows, read_documents, read_rows
from .tokenizer import UNKNOWN_SAMPLE, UnknownShare, check_tokenizer, judge_unknown, unknown_share

IGNORE = -100
ENCODE_BATCH = 1024  # documents per tokenizer call: parallel inside a call, progress shown between calls
DROPPED_SHOWN = 5  # rows of dropped examples named in messages
CHAT_FORMATS = ("chat", "sharegpt")


def _progress(items, total: int | None, what: str, show: bool | None):
    """A progress bar over a dataset's records while they are tokenized (`show` None: on a terminal only)."""
    return bar(items, total=total, desc=f"tokenizing {what}", unit="row", show=show)


@dataclass
class Example:
    input_ids: torch.Tensor  # long [n]
    labels: torch.Tensor  # long [n], IGNORE where no loss
    where: str  # "file:line" or "file row N", for messages and `slide-train data`
    splittable: bool  # may be cut at a row boundary when packing (plain text)
    row: int = 0  # the record's number in its file (1-based), for messages about dropped examples

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class ExampleSet:
    source: Path
    examples: list[Example] = field(default_factory=list)
    records: int = 0  # documents or rows read
    truncated: int = 0  # alpaca/chat/sharegpt examples cut to seq_len
    dropped: int = 0  # examples with no loss token (empty, or all cut off by truncation)
    dropped_rows: list[int] = field(default_factory=list)  # the first DROPPED_SHOWN rows of dropped examples
    unit: str = "row"  # what the record numbers count: "line" (jsonl, text) or "row"
    # `tokens` rows longer than seq_len are cut into pieces: those of them with no loss token, dropped
    dropped_pieces: int = 0
    dropped_piece_tokens: int = 0
    dropped_piece_rows: list[int] = field(default_factory=list)
    # The first UNKNOWN_SAMPLE records' (text, ids, where) until measured, and what was measured of them
    probe: list[tuple[str, list[int], str]] = field(default_factory=list)
    unknown: UnknownShare | None = None

    def probed(self, text: str, ids: list[int], record: Record) -> None:
        if len(self.probe) < UNKNOWN_SAMPLE:
            self.probe.append((text, list(ids), record.where))

    def add(self, ids: list[int], labels: list[int], record: Record, splittable: bool = False) -> None:
        """One example of the record, or a drop when none of its tokens has a loss (e.g. a conversation with no
        assistant turn, or `tokens` labels all -100): checked here, so drops are met in file order."""
        labels = list(labels)
        if labels:
            labels[0] = IGNORE
        if all(t == IGNORE for t in labels):
            self.drop(record.number)
            return
        self.examples.append(Example(torch.tensor(ids, dtype=torch.long), torch.tensor(labels, dtype=torch.long),
                                     record.where, splittable, record.number))

    def drop(self, row: int) -> None:
        self.dropped += 1
        if len(self.dropped_rows) < DROPPED_SHOWN and row not in self.dropped_rows:
            self.dropped_rows.append(row)

    def drop_piece(self, row: int, tokens: int) -> None:
        self.dropped_pieces += 1
        self.dropped_piece_tokens += tokens
        if len(self.dropped_piece_rows) < DROPPED_SHOWN and row not in self.dropped_piece_rows:
            self.dropped_piece_rows.append(row)

    def dropped_where(self, pieces: bool = False) -> str:
        """ "lines 2, 5, 9" (or "rows ..."), "..." past the first DROPPED_SHOWN; "" when none was dropped.
        `pieces`: the rows of the dropped pieces instead."""
        rows, count = (self.dropped_piece_rows, self.dropped_pieces) if pieces else (self.dropped_rows, self.dropped)
        if not rows:
            return ""
        more = ", ..." if count > len(rows) else ""
        unit = self.unit if len(rows) == 1 and not more else self.unit + "s"
        return f"{unit} {', '.join(map(str, rows))}{more}"


def _counted(out: ExampleSet, records: Iterable[Record]) -> Iterator[Record]:
    """The records, counted into out.records as they are read (an arrow-backed file is read once, lazily)."""
    for record in records:
        out.records += 1
        yield record


def _batched(items: Iterable, n: int) -> Iterator[list]:
    items = iter(items)
    while batch := list(islice(items, n)):
        yield batch


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _bos(tokenizer) -> list[int]:
    return [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]


def _eos(tokenizer) -> list[int]:
    return [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]


def _text_examples(out: ExampleSet, records: Records, cfg: DataConfig, tokenizer, progress: bool | None) -> None:
    batches = -(-records.total // ENCODE_BATCH) if records.total is not None else None
    # Batched calls: tokenizers encodes each batch in parallel, which matters for large corpora.
    for batch in _progress(_batched(_counted(out, records), ENCODE_BATCH), batches,
                           f"{records.path.name} (batches)", progress):
        texts = [r.value if isinstance(r.value, str) else get_key(r.value, cfg.text_key, r.where) for r in batch]
        for record, text, ids in zip(batch, texts, tokenizer(texts, add_special_tokens=False)["input_ids"]):
            out.probed(text, ids, record)
            if not ids:  # an empty document: bos then eos would teach only that documents can be empty
                out.drop(record.number)
                continue
            ids = _bos(tokenizer) + list(ids) + _eos(tokenizer)
            out.add(ids, ids, record, splittable=True)  # (one token, no bos/eos: nothing to predict, dropped)


ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n{input}### Response:\n"
ALPACA_INPUT = "### Input:\n{input}\n\n"


def alpaca_prompt(instruction: str, input: str) -> str:
    """The prompt part of an alpaca example (no loss); the output follows it directly."""
    return ALPACA_PROMPT.format(
        instruction=instruction, input=ALPACA_INPUT.format(input=input) if input else ""
    )


def _trained_spans(tokenizer, text: str, spans: list[tuple[int, int]]):
    """`text` tokenized, with labels on the tokens inside `spans` (character ranges) and IGNORE elsewhere.

    A fast tokenizer encodes the text once and its offsets place each token: one that touches a span is
    trained. Tokenizing the pieces apart would give each a start of text, where SentencePiece-style tokenizers
    (a Metaspace prefix) add a token the whole text does not have. A slow tokenizer (no offsets) encodes the
    pieces between span boundaries apart instead, so no token straddles one."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        # A token overlapping a span is trained; a zero-width one (trimmed offsets) goes with what precedes it.
        trained = [any(s < b and e > a if e > s else a < s <= b for a, b in spans) for s, e in enc["offset_mapping"]]
        return ids, [t if keep else IGNORE for t, keep in zip(ids, trained)]
    ids, labels = [], []
    cuts = sorted({0, len(text), *(x for span in spans for x in span)})
    for a, b in zip(cuts, cuts[1:]):
        piece = _encode(tokenizer, text[a:b])
        ids += piece
        labels += piece if (a, b) in spans else [IGNORE] * len(piece)
    return ids, labels


def _alpaca_example(row: dict, where: str, tokenizer) -> tuple[list[int], list[int], str]:
    instruction = get_key(row, "instruction", where)
    input = get_key(row, "input", where, (str, type(None)), required=False) or ""
    output = get_key(row, "output", where)
    prompt = alpaca_prompt(instruction, input)
    text = prompt + output
    ids, labels = _trained_spans(tokenizer, text, [(len(prompt), len(text))])
    bos, eos = _bos(tokenizer), _eos(tokenizer)
    return bos + ids + eos, [IGNORE] * len(bos) + labels + eos, text


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # the template is user code: any error is a data problem at this row
        raise DataError(f"{where}: the tokenizer's chat template failed on this conversation ({e})") from e


def _chat_example(messages: list[dict], where: str, tokenizer) -> tuple[list[int], list[int], str]:
    """Loss on assistant turns only, found by rendering prefixes of the conversation.

    Assistant turn i spans from the end of render(messages[:i], add_generation_prompt=True) to the end
    of render(messages[:i+1]); both must be prefixes of the whole rendering, which holds for templates
    that render a conversation turn by turn. The whole rendering is tokenized once and the tokens within
    those spans are trained (`_trained_spans`).
    """
    full = _render(tokenizer, messages, False, where)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i == 0:  # an opening assistant turn answers nothing: context, untrained
            continue
        start = _render(tokenizer, messages[:i], True, where)
        end = _render(tokenizer, messages[: i + 1], False, where)
        if not (full.startswith(start) and full.startswith(end)
                and (spans[-1][1] if spans else 0) <= len(start) <= len(end)):
            raise DataError(
                f"{where}: cannot find assistant turn {i} in the chat template's output: the template "
                "does not render the conversation turn by turn (a prefix renders differently from the whole)"
            )
        spans.append((len(start), len(end)))
    return *_trained_spans(tokenizer, full, spans), full


def _tokens_examples(out: ExampleSet, records: Iterable[Record], tokenizer, seq_len: int,
                     vocab_size: int | None) -> None:
    # The model's vocabulary bounds the ids (its embedding); else the tokenizer's; with neither, only negative
    # ids can be caught here. JSON true/false are not ids (bool is an int subclass in Python).
    vocab = vocab_size or (len(tokenizer) if tokenizer is not None else float("inf"))
    for record in records:
        row, where = record.value, record.where
        ids = get_key(row, "input_ids", where, list)
        labels = get_key(row, "labels", where, list, required=False)
        # Without labels a row is a document of plain tokens: packing may cut it at a row's end, as it cuts text
        splittable = labels is None
        if labels is None:
            labels = ids
        if not all(type(t) is int and 0 <= t < vocab for t in ids):
            raise DataError(
                f"{where}: 'input_ids' must be integers in [0, {vocab}) (the vocabulary)"
            )
        if len(labels) != len(ids):
            raise DataError(f"{where}: 'labels' has {plural(len(labels), 'entry', 'entries')} but 'input_ids' "
                            f"has {len(ids)}")
        if not all(type(t) is int and (t == IGNORE or 0 <= t < vocab) for t in labels):
            raise DataError(f"{where}: 'labels' must be integers in [0, {vocab}) or -100")
        # Each piece's first label is masked (`add`): a piece of one token, the overflow of a row one token
        # longer than seq_len, has none left. The row is dropped only when none of its pieces trains.
        pieces = [(ids[a : a + seq_len], labels[a : a + seq_len]) for a in range(0, len(ids), seq_len)]
        trains = [any(t != IGNORE for t in piece_labels[1:]) for _, piece_labels in pieces]
        if not any(trains):
            out.drop(record.number)
            continue
        for (piece, piece_labels), kept in zip(pieces, trains):
            if kept:
                out.add(piece, piece_labels, record, splittable=splittable)
            else:
                out.drop_piece(record.number, len(piece))


def _row_examples(out: ExampleSet, records: Records, cfg: DataConfig, tokenizer, seq_len: int,
                  progress: bool | None) -> None:
    """alpaca, chat and sharegpt rows: one example each, truncated to seq_len."""
    if cfg.format == "alpaca":
        make = _alpaca_example
    else:
        roles = RoleMap(cfg.roles, SHAREGPT_ROLES if cfg.format == "sharegpt" else None)
        messages = chat_messages if cfg.format == "chat" else sharegpt_messages

        def make(row, where, tokenizer):
            return _chat_example(messages(row, where, roles), where, tokenizer)

    for record in _progress(_counted(out, records), records.total, records.path.name, progress):
        ids, labels, text = make(record.value, record.where, tokenizer)
        out.probed(text, ids, record)
        if len(ids) > seq_len:
            ids, labels = ids[:seq_len], labels[:seq_len]
            out.truncated += 1
        out.add(ids, labels, record)


def load_examples(cfg: DataConfig, tokenizer, seq_len: int, vocab_size: int | None = None,
                  progress: bool | None = None) -> ExampleSet:
    """All examples of the dataset, in file order, with counts of what was truncated or dropped; token ids are
    checked against `vocab_size` (the model's) where given. `progress`: show tokenization progress (None: on a
    terminal only)."""
    path = Path(cfg.path) if cfg.path is not None else builtin_corpus_path()
    check_file(path)
    if tokenizer is None and cfg.format != "tokens":
        raise DataError(
            f"data.format {cfg.format!r} needs a tokenizer; only format 'tokens' runs without one"
        )
    if cfg.format != "tokens":
        check_tokenizer(tokenizer, cfg.format)
    text = cfg.format in ("text", "jsonl")
    if not text and not has_rows(path):
        raise DataError(f"{path}: format {cfg.format!r} reads {ROW_FILES}")
    if cfg.format in CHAT_FORMATS and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"data.format {cfg.format!r} needs a tokenizer with a chat template, and this tokenizer has none: "
            "use a model directory whose tokenizer defines one, or format 'alpaca' or 'text'"
        )
    records = read_rows(path) if cfg.format == "jsonl" or has_rows(path) else read_documents(path)
    out = ExampleSet(source=path, unit=records.unit)
    if text:
        _text_examples(out, records, cfg, tokenizer, progress)
    elif cfg.format == "tokens":
        _tokens_examples(out, _counted(out, records), tokenizer, seq_len, vocab_size)
    else:
        _row_examples(out, records, cfg, tokenizer, seq_len, progress)
    if cfg.format != "tokens":  # (ids given as such are the model's by construction)
        out.unknown = unknown_share(tokenizer, out.probe)
        out.probe = []
        judge_unknown(out.unknown, tokenizer, path, cfg.allow_unknown_tokens)
    if not out.examples:
        raise DataError(_empty_reason(out, cfg, seq_len))
    return out


def _empty_reason(out: ExampleSet, cfg: DataConfig, seq_len: int) -> str:
    if out.records == 0:
        what = "documents (it is empty, or only blank lines)" if cfg.format == "text" else "rows"
        return f"{out.source}: the dataset yields no tokens: the file has no {what}"
    unit = "document" if cfg.format in ("text", "jsonl") else "row"
    reason = f"{plural(out.records, unit)} read, none has a label token"
    if out.truncated:
        reason += (
            f"; {out.truncated} {'was' if out.truncated == 1 else 'were'} truncated to seq_len={seq_len}, which "
            "cut off the part with the loss"
        )
    if cfg.format in CHAT_FORMATS:
        reason += "; only assistant turns carry a loss"
    return f"{out.source}: the dataset yields no tokens to train on ({reason})"
