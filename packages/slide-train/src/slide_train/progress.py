"""Progress bars for the long parts of a run (tokenizing, loading weights, checkpoints, exports)."""

from __future__ import annotations

from tqdm.auto import tqdm


def bar(items=None, *, desc: str, unit: str, total: int | None = None, show: bool | None = None):
    """A transient tqdm bar over `items` (or updated by hand). `show` None: on a terminal only."""
    return tqdm(items, desc=desc, total=total, unit=unit, leave=False, disable=None if show is None else not show)
