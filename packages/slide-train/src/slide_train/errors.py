"""Errors a user can act on: each names the file, key or value at fault and what would fix it."""


class SlideError(Exception):
    """Base class: the CLI prints these without a traceback."""


class ConfigError(SlideError, ValueError):
    pass


class ModelError(SlideError, ValueError):
    pass


class CheckpointError(SlideError):
    pass


class DiskFullError(SlideError):
    """A checkpoint or an export did not fit on its disk; nothing of it was left behind."""


class ExportError(SlideError):
    pass


class TrainingError(SlideError):
    """The run cannot go on (e.g. a non-finite loss); what is on disk is intact."""


def size_text(nbytes: float) -> str:
    """Bytes for a message: GB, or MB below 0.1 GB (where GB would read 0.0)."""
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"



def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """A count with its noun in agreement: "1 example", "2 examples" (`nouns`: an irregular plural)."""
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"
