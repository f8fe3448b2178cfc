"""The `data:` section of a run's config, and the one error type the data pipeline raises."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SlideError

# `jsonl` is `text` read from jsonl rows whatever the file's extension (DESIGN.md section 4 lists it).
FORMATS = ("text", "jsonl", "alpaca", "chat", "tokens")


class DataError(SlideError, ValueError):
    """A dataset or data setting that cannot be used; the message names the file, line or key at fault."""


@dataclass
class DataConfig:
    path: str | None = None  # None -> the built-in corpus that ships with the package
    format: str = "text"  # one of FORMATS
    text_key: str = "text"  # the key of jsonl rows for `text` / `jsonl`
    shuffle: bool = True
    pack: bool = True  # pack short examples into seq_len rows
    eval_fraction: float = 0.0  # held-out share of examples for validation loss
    eval_batches: int = 4


def check_config(cfg: DataConfig, seq_len: int, micro_batch_size: int) -> None:
    """Fail before reading any file when a setting cannot work."""
    if cfg.format not in FORMATS:
        raise DataError(f"data.format: unknown format {cfg.format!r}; valid formats: {', '.join(FORMATS)}")
    if cfg.path is None and cfg.format != "text":
        raise DataError(
            f"data.path: format {cfg.format!r} needs a file; only format 'text' has a built-in corpus"
        )
    if not 0.0 <= cfg.eval_fraction < 1.0:
        raise DataError(f"data.eval_fraction: must be in [0, 1), got {cfg.eval_fraction}")
    if cfg.eval_batches < 1:
        raise DataError(f"data.eval_batches: must be at least 1, got {cfg.eval_batches}")
    if seq_len < 2:
        raise DataError(f"seq_len: must be at least 2 (the loss predicts token t+1 from t), got {seq_len}")
    if micro_batch_size < 1:
        raise DataError(f"micro_batch_size: must be at least 1, got {micro_batch_size}")
