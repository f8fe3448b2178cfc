"""A store striped over drives: an NVMe store per folder (one folder per drive), each with a reader and a writer
thread of its own, so the drives move at once, each in the order it was given. The scheduler's disk states and
disk activations each hold one."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from slide_io.nvme import NVMeStore

Folders = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


def folders_of(directory: Folders) -> list[str]:
    """The drives' folders: one folder, or a list of them (one per drive)."""
    if isinstance(directory, (str, os.PathLike)):
        return [os.fspath(directory)]
    return [os.fspath(d) for d in directory]


class Drives:
    """Stores under `directory` (a folder, or one per drive) for the drives `used` names; `reserve(drive)`: the
    bytes that drive's store must have room for (checked as it opens: a run that cannot fit stops before it
    starts). `what` names the files in errors, `name` the threads."""

    def __init__(self, directory: Folders, used: Iterable[int], what: str, name: str,
                 reserve: Callable[[int], int] = lambda drive: 0):
        folders = folders_of(directory)
        used = set(used)
        if used and max(used) >= len(folders):
            raise ValueError(f"the placement stripes {what} over {1 + max(used)} drives, given {len(folders)} "
                             f"folder(s): {', '.join(folders)}")
        self.stores = [NVMeStore(folder, reserve=reserve(d)) for d, folder in enumerate(folders)]
        self.readers = [ThreadPoolExecutor(1, thread_name_prefix=f"slide-{name}-read-{d}") for d in range(len(folders))]
        self.writers = [ThreadPoolExecutor(1, thread_name_prefix=f"slide-{name}-write-{d}")
                        for d in range(len(folders))]

    def __len__(self) -> int:
        return len(self.stores)

    def close(self) -> None:
        """Finish every transfer queued on any drive, then remove the files."""
        for pool in self.writers + self.readers:
            pool.shutdown(wait=True)
        for store in self.stores:
            store.close()
