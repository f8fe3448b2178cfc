"""The `data:` section of a run's config, and the one error type the data pipeline raises."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import SlideError

# The layout of a dataset's rows; the file type comes from data.path (sources.py). `jsonl` is `text` read from
# rows, and from JSON lines whatever the file's extension.
FORMATS = ("text", "jsonl", "alpaca", "chat", "sharegpt", "tokens")

# The roles of HF chat messages, which chat templates render. data.roles maps other names onto them; a name mapped
# to itself (e.g. {developer: developer}) is a role of the model's own template, passed on as written.
ROLES = ("system", "user", "assistant", "tool")


class DataError(SlideError, ValueError):
    """A dataset or data setting that cannot be used; the message names the file, line or key at fault."""


@dataclass
class DataConfig:
    path: str | None = None  # None: the built-in corpus; a .jsonl, .json, .parquet, .arrow or save_to_disk folder
    format: str = "text"  # one of FORMATS
    text_key: str = "text"  # the key of rows for `text` / `jsonl`
    roles: dict = field(default_factory=dict)  # role names of chat/sharegpt rows -> ROLES, e.g. {usr: user}
    shuffle: bool = True
    pack: bool = True  # pack short examples into seq_len rows
    eval_fraction: float = 0.0  # held-out share of examples for validation loss
    eval_batches: int = 4
    allow_unknown_tokens: bool = False  # train where over half the tokens are unknown to the tokenizer


def check_config(cfg: DataConfig, seq_len: int, micro_batch_size: int) -> None:
    """Fail before reading any file when a setting cannot work."""
    if cfg.format not in FORMATS:
        raise DataError(f"data.format: unknown format {cfg.format!r}; valid formats: {', '.join(FORMATS)}")
    if cfg.path is None and cfg.format != "text":
        raise DataError(
            f"data.path: format {cfg.format!r} needs a file; only format 'text' has a built-in corpus"
        )
    check_roles(cfg.roles)
    if not 0.0 <= cfg.eval_fraction < 1.0:
        raise DataError(f"data.eval_fraction: must be in [0, 1), got {cfg.eval_fraction}")
    if cfg.eval_batches < 1:
        raise DataError(f"data.eval_batches: must be at least 1, got {cfg.eval_batches}")
    if seq_len < 2:
        raise DataError(f"seq_len: must be at least 2 (the loss predicts token t+1 from t), got {seq_len}")
    if micro_batch_size < 1:
        raise DataError(f"micro_batch_size: must be at least 1, got {micro_batch_size}")


def check_roles(roles) -> None:
    """data.roles maps names to ROLES, or a name to itself; YAML reads some unquoted names (`yes`, `on`) as other
    types, and a misspelt target would pass a role the template does not know."""
    if not isinstance(roles, dict):
        raise DataError(f"data.roles: must map role names to roles, e.g. {{usr: user}}; got {roles!r}")
    for name, role in roles.items():
        if not (isinstance(name, str) and name and isinstance(role, str) and role):
            raise DataError(f"data.roles: {name!r}: {role!r} is not one role name mapped to another; quote both")
        if role not in ROLES and role != name:
            raise DataError(
                f"data.roles: {name!r} maps to {role!r}, which is not one of the roles {', '.join(ROLES)}; a role "
                f"of the model's own template is mapped to itself (e.g. {{{role}: {role}}})"
            )
