"""Progress bars for the long parts of a run (tokenizing, loading weights, checkpoints, exports)."""

from __future__ import annotations

from tqdm.auto import tqdm

_hidden = False  # `--no-progress`: the whole process shows no bar


def hide_bars() -> None:
    """No bar from now on, whatever a caller asks (`slide-train finetune --no-progress`)."""
    global _hidden
    _hidden = True


def bar(items=None, *, desc: str, unit: str, total: int | None = None, show: bool | None = None):
    """A transient tqdm bar over `items` (or updated by hand). `show` None: on a terminal only."""
    disable = True if _hidden else None if show is None else not show
    return tqdm(items, desc=desc, total=total, unit=unit, leave=False, disable=disable)
