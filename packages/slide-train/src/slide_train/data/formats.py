"""Turning records into token examples: ids, labels (-100 where no loss) and whether they may be split.

Truncation policy, per format:
- `text` / `jsonl`: a document is `[bos] + tokens + [eos]` (each only when the tokenizer has it). A document
  longer than seq_len is never cut off: packing splits it at row boundaries, and each part trains.
- `tokens`: rows are used exactly as given (no bos/eos added); a row longer than seq_len is split into
  seq_len chunks, each its own example.
- `alpaca` / `chat`: an example longer than seq_len is truncated to seq_len (its end is lost) and counted;
  build_data warns with the count. An example left with no loss token is dropped and counted.

Every example's first label is -100: the loss shifts by one, so the first token of a document would be
predicted from the previous document's last token, which its attention cannot see once packed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..progress import bar
from .config import DataConfig, DataError
from .corpus import builtin_corpus_path
from .sources import JSON_SUFFIXES, check_file, get_key, read_documents, read_rows

IGNORE = -100
ENCODE_BATCH = 1024  # documents per tokenizer call: parallel inside a call, progress shown between calls


def _progress(items, total: int, what: str, show: bool | None):
    """A progress bar over a dataset's records while they are tokenized (`show` None: on a terminal only)."""
    return bar(items, total=total, desc=f"tokenizing {what}", unit="row", show=show)


@dataclass
class Example:
    input_ids: torch.Tensor  # long [n]
    labels: torch.Tensor  # long [n], IGNORE where no loss
    where: str  # file:line, for messages and `slide-train data`
    splittable: bool  # may be cut at a row boundary when packing (plain text)

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class ExampleSet:
    source: Path
    examples: list[Example] = field(default_factory=list)
    records: int = 0  # documents or rows read
    truncated: int = 0  # alpaca/chat examples cut to seq_len
    dropped: int = 0  # examples with no loss token (empty, or all cut off by truncation)


def _example(ids: list[int], labels: list[int], where: str, splittable: bool = False) -> Example:
    labels = list(labels)
    labels[0] = IGNORE
    return Example(
        torch.tensor(ids, dtype=torch.long), torch.tensor(labels, dtype=torch.long), where, splittable
    )


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _bos(tokenizer) -> list[int]:
    return [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]


def _eos(tokenizer) -> list[int]:
    return [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]


def _text_examples(out: ExampleSet, cfg: DataConfig, tokenizer, progress: bool | None) -> None:
    path = out.source
    if cfg.format == "jsonl" or path.suffix in JSON_SUFFIXES:
        docs = [(where, get_key(row, cfg.text_key, where)) for where, row in read_rows(path)]
    else:
        docs = read_documents(path)
    out.records = len(docs)
    if not docs:
        return
    # Batched calls: tokenizers encodes each batch in parallel, which matters for large corpora.
    batches = (docs[i : i + ENCODE_BATCH] for i in range(0, len(docs), ENCODE_BATCH))
    encoded = [ids for batch in _progress(batches, -(-len(docs) // ENCODE_BATCH), f"{path.name} (batches)",
                                          progress)
               for ids in tokenizer([text for _, text in batch], add_special_tokens=False)["input_ids"]]
    for (where, _), ids in zip(docs, encoded):
        if not ids:  # an empty document: bos then eos would teach only that documents can be empty
            out.dropped += 1
            continue
        ids = _bos(tokenizer) + list(ids) + _eos(tokenizer)
        if len(ids) < 2:  # one token, no bos/eos: nothing to predict
            out.dropped += 1
            continue
        out.examples.append(_example(ids, ids, where, splittable=True))


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


def _alpaca_example(row: dict, where: str, tokenizer) -> tuple[list[int], list[int]]:
    instruction = get_key(row, "instruction", where)
    input = get_key(row, "input", where, (str, type(None)), required=False) or ""
    output = get_key(row, "output", where)
    prompt = alpaca_prompt(instruction, input)
    text = prompt + output
    ids, labels = _trained_spans(tokenizer, text, [(len(prompt), len(text))])
    bos, eos = _bos(tokenizer), _eos(tokenizer)
    return bos + ids + eos, [IGNORE] * len(bos) + labels + eos


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # the template is user code: any error is a data problem at this row
        raise DataError(f"{where}: the tokenizer's chat template failed on this conversation ({e})") from e


def _chat_example(row: dict, where: str, tokenizer) -> tuple[list[int], list[int]]:
    """Loss on assistant turns only, found by rendering prefixes of the conversation.

    Assistant turn i spans from the end of render(messages[:i], add_generation_prompt=True) to the end
    of render(messages[:i+1]); both must be prefixes of the whole rendering, which holds for templates
    that render a conversation turn by turn. The whole rendering is tokenized once and the tokens within
    those spans are trained (`_trained_spans`).
    """
    messages = get_key(row, "messages", where, list)
    for j, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(f"{where}: messages[{j}] must be an object with 'role' and 'content'")
        get_key(m, "role", f"{where} messages[{j}]")
        get_key(m, "content", f"{where} messages[{j}]")
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
    return _trained_spans(tokenizer, full, spans)


def _tokens_examples(out: ExampleSet, rows: list[tuple[str, dict]], tokenizer, seq_len: int,
                     vocab_size: int | None) -> None:
    # The model's vocabulary bounds the ids (its embedding); else the tokenizer's; with neither, only negative
    # ids can be caught here. JSON true/false are not ids (bool is an int subclass in Python).
    vocab = vocab_size or (len(tokenizer) if tokenizer is not None else float("inf"))
    for where, row in rows:
        ids = get_key(row, "input_ids", where, list)
        labels = get_key(row, "labels", where, list, required=False)
        if labels is None:
            labels = ids
        if not all(type(t) is int and 0 <= t < vocab for t in ids):
            raise DataError(
                f"{where}: 'input_ids' must be integers in [0, {vocab}) (the vocabulary)"
            )
        if len(labels) != len(ids):
            raise DataError(f"{where}: 'labels' has {len(labels)} entries but 'input_ids' has {len(ids)}")
        if not all(type(t) is int and (t == IGNORE or 0 <= t < vocab) for t in labels):
            raise DataError(f"{where}: 'labels' must be integers in [0, {vocab}) or -100")
        if not ids:
            out.dropped += 1
            continue
        for a in range(0, len(ids), seq_len):
            out.examples.append(_example(ids[a : a + seq_len], labels[a : a + seq_len], where))


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
    out = ExampleSet(source=path)
    if cfg.format in ("text", "jsonl"):
        _text_examples(out, cfg, tokenizer, progress)
    else:
        if path.suffix not in JSON_SUFFIXES:
            raise DataError(f"{path}: format {cfg.format!r} reads .jsonl or .json files")
        if cfg.format == "chat" and not getattr(tokenizer, "chat_template", None):
            raise DataError(
                "data.format 'chat' needs a tokenizer with a chat template, and this tokenizer has none: "
                "use a model directory whose tokenizer defines one, or format 'alpaca' or 'text'"
            )
        rows = read_rows(path)
        out.records = len(rows)
        if cfg.format == "tokens":
            _tokens_examples(out, rows, tokenizer, seq_len, vocab_size)
        else:
            make = _alpaca_example if cfg.format == "alpaca" else _chat_example
            for where, row in _progress(rows, len(rows), path.name, progress):
                ids, labels = make(row, where, tokenizer)
                if len(ids) > seq_len:
                    ids, labels = ids[:seq_len], labels[:seq_len]
                    out.truncated += 1
                if ids:
                    out.examples.append(_example(ids, labels, where))
    # Examples can also have no loss token (e.g. `tokens` rows whose labels are all -100): drop them too.
    kept = [ex for ex in out.examples if bool((ex.labels != IGNORE).any())]
    out.dropped += len(out.examples) - len(kept)
    out.examples = kept
    if not out.examples:
        raise DataError(_empty_reason(out, cfg, seq_len))
    return out


def _empty_reason(out: ExampleSet, cfg: DataConfig, seq_len: int) -> str:
    if out.records == 0:
        what = "documents (it is empty, or only blank lines)" if cfg.format == "text" else "rows"
        return f"{out.source}: the dataset yields no tokens: the file has no {what}"
    unit = "documents" if cfg.format in ("text", "jsonl") else "rows"
    reason = f"{out.records} {unit} read, none has a label token"
    if out.truncated:
        reason += (
            f"; {out.truncated} were truncated to seq_len={seq_len}, which cut off the part with the loss"
        )
    if cfg.format == "chat":
        reason += "; only assistant turns carry a loss"
    return f"{out.source}: the dataset yields no tokens to train on ({reason})"
