"""Messages a person reads: each warning as one line on the terminal, its full detail in the run's `log.txt`.

slide-train's modules warn with `warnings.warn`, so a program using them as a library keeps Python's own
machinery (filters, `pytest.warns`). The command line routes those warnings through the `slide_train` logger:
one line on stderr, written above any progress bar, and a line with the warning's category and origin in the
run's `log.txt`, beside `metrics.jsonl`, together with what the run prints.
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import sys
import warnings

from tqdm import tqdm

LOGGER = "slide_train"
LOG_FILE = "log.txt"


class _Console(logging.Handler):
    """stderr, through tqdm so that a bar on the terminal is redrawn below the line rather than broken."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # a closed stream must not take the run down with it
            self.handleError(record)


class _OneLine(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = " ".join(record.getMessage().split())  # a multi-line message reads as one line
        return f"slide-train: {record.levelname.lower()}: {text}"


class _Detailed(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        origin = getattr(record, "origin", "")
        when = self.formatTime(record, "%Y-%m-%d %H:%M:%S")
        return f"{when} {record.levelname.lower()}: {record.getMessage()}" + (f" [{origin}]" if origin else "")


def logger() -> logging.Logger:
    return logging.getLogger(LOGGER)


def _show(message, category, filename, lineno, file=None, line=None) -> None:
    logger().warning("%s", message, extra={"origin": f"{category.__name__} at {filename}:{lineno}"})


@contextlib.contextmanager
def console():
    """While the command runs: warnings as `slide-train: warning: ...` lines, once per message."""
    log = logger()
    handler = _Console()
    handler.setFormatter(_OneLine())
    handler.setLevel(logging.INFO)
    previous = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # each distinct warning once, as Python shows them
        warnings.showwarning = _show
        try:
            yield log
        finally:
            log.removeHandler(handler)
            log.setLevel(previous[0])
            log.propagate = previous[1]


@contextlib.contextmanager
def run_log(run_dir: str | pathlib.Path):
    """Append what the `slide_train` logger says, in detail, to `<run_dir>/log.txt` while the block runs."""
    path = pathlib.Path(run_dir) / LOG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(_Detailed())
    handler.setLevel(logging.DEBUG)
    log = logger()
    log.addHandler(handler)
    try:
        yield path
    finally:
        log.removeHandler(handler)
        handler.close()


def say(text: str) -> None:
    """A line for the user: on stdout as it is (printed above a progress bar), and into the run's log.txt."""
    tqdm.write(text, file=sys.stdout)
    sys.stdout.flush()
    log = logger()
    for handler in log.handlers:  # only the run's file: the console already has it on stdout
        if isinstance(handler, logging.FileHandler):
            handler.handle(log.makeRecord(LOGGER, logging.INFO, "", 0, text, None, None))
