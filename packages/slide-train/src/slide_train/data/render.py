"""`slide-train data CONFIG`: a few examples as the model will see them, with no-loss spans marked."""

from __future__ import annotations

from ..errors import plural
from .config import DataConfig, check_config
from .formats import IGNORE, ExampleSet, load_examples

OPEN, CLOSE = "⟦", "⟧"


def _spans(ids: list[int], labels: list[int]) -> list[tuple[bool, list[int]]]:
    """Runs of consecutive tokens that share the same has-loss flag."""
    runs: list[tuple[bool, list[int]]] = []
    for t, label in zip(ids, labels):
        trained = label != IGNORE
        if runs and runs[-1][0] == trained:
            runs[-1][1].append(t)
        else:
            runs.append((trained, [t]))
    return runs


def render_example(tokenizer, ids: list[int], labels: list[int]) -> str:
    """The decoded text, or the ids themselves when there is no tokenizer (format `tokens`)."""
    parts = []
    for trained, run in _spans(ids, labels):
        if tokenizer is None:
            text = " ".join(map(str, run)) + " "
        else:
            text = tokenizer.decode(run, skip_special_tokens=False)
        parts.append(text if trained else f"{OPEN}{text}{CLOSE}")
    return "".join(parts)


def render_examples(cfg: DataConfig, tokenizer, seq_len: int, n: int = 3, loaded: ExampleSet | None = None,
                    summary: bool = True) -> str:
    """The first `n` examples with their loss spans marked; `loaded`: examples already read with this config.
    `summary`: begin with a line of counts (False where the caller has printed the data's own summary)."""
    if loaded is None:
        check_config(cfg, seq_len, 1)
        loaded = load_examples(cfg, tokenizer, seq_len)
    lines = [
        f"{loaded.source} (format {cfg.format}): {plural(len(loaded.examples), 'example')} "
        f"from {plural(loaded.records, 'record')}; "
        f"{loaded.truncated} truncated to seq_len={seq_len}, {loaded.dropped} dropped (no loss token"
        + (f": {loaded.dropped_where()})" if loaded.dropped else ")")
        + (f"; {plural(loaded.dropped_pieces, 'piece')} of rows longer than seq_len dropped (no loss token: "
           f"{loaded.dropped_where(pieces=True)})" if loaded.dropped_pieces else ""),
    ] if summary else []
    lines.append(f"text inside {OPEN} {CLOSE} has no loss (label -100); the rest is trained on")
    for ex in loaded.examples[:n]:
        ids, labels = ex.input_ids[:seq_len].tolist(), ex.labels[:seq_len].tolist()
        trained = sum(label != IGNORE for label in labels)
        more = f", {len(ex) - seq_len} more continue in the next row" if len(ex) > seq_len else ""
        lines += [
            "",
            f"--- {ex.where}: {plural(len(ids), 'token')}, {trained} with loss{more}",
            render_example(tokenizer, ids, labels),
        ]
    return "\n".join(lines)
