"""The errors slide-io adds: a tier without room for what it was asked to hold, and a file of the tier that no
longer holds what was written to it."""

from __future__ import annotations

import errno

FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


def is_disk_full(error: BaseException) -> bool:
    """A full disk (or quota), as an OSError or as a library reports it in its message (kvikio's RuntimeError,
    safetensors' SafetensorError carry the C library's text)."""
    if isinstance(error, OSError):
        return error.errno in FULL_ERRNOS
    return "No space left on device" in str(error)


def _size(nbytes: int) -> str:
    return f"{nbytes:,} bytes ({nbytes / 2**30:.2f} GiB)"


class StoreFullError(OSError):
    """A directory has too little free space: at preflight, or when a write hit ENOSPC.

    It is an OSError with errno ENOSPC, so code that already handles a full disk keeps working;
    `directory`, `needed` and `free` say what was asked of which directory.
    """

    def __init__(self, directory: str, needed: int, free: int, what: str = "") -> None:
        self.directory = str(directory)
        self.needed = int(needed)
        self.free = int(free)
        self.what = what
        message = (
            f"slide-io: {what or 'the store'} needs {_size(self.needed)} in {self.directory}, "
            f"but only {_size(self.free)} are free there; free some space or point the store at "
            "another directory (e.g. a larger NVMe mount)"
        )
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror or ""

    def __reduce__(self):  # rebuilt from its own arguments (OSError's would be errno and message)
        return type(self), (self.directory, self.needed, self.free, self.what)


class StoreCorruptError(OSError):
    """A file of the NVMe tier is not as this process left it: it holds fewer bytes than were written to it, or it
    was written or replaced since (`changed`), by another program or a user clearing the folder. An OSError with
    errno EIO."""

    def __init__(self, path: str, key: str, expected: int, found: int, changed: bool = False) -> None:
        self.path, self.key, self.expected, self.found = str(path), key, int(expected), int(found)
        self.changed = bool(changed)
        what = (f"was written or replaced outside this run after it last wrote the {expected:,} bytes there"
                if changed else f"holds {found:,} bytes, but {expected:,} were written to it: the file was "
                                "truncated or replaced outside this run")
        message = (f"slide-io: {self.path} (key {key!r}) {what}; the run cannot go on from it (resume from a "
                   "checkpoint)")
        super().__init__(errno.EIO, message)

    def __str__(self) -> str:
        return self.strerror or ""

    def __reduce__(self):
        return type(self), (self.path, self.key, self.expected, self.found, self.changed)
