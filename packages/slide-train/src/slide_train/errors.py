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
