"""Messages a person reads: each warning as one line on the terminal, its full detail in the run's `log.txt`.

slide-train's modules warn with `warnings.warn`, so a program using them as a library keeps Python's own
machinery (filters, `pytest.warns`). The command line routes those warnings through the `slide_train` logger:
one line on stderr, written above any progress bar, and a line with the warning's category and origin in the
run's `log.txt`, beside `metrics.jsonl`, together with what the run prints.
"""

from __future__ import annotations

import contextlib
import logging
import os
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


class _RunFile(logging.Handler):
    """The run's log.txt: records wait here until the run knows its folder (`open_run_log`), then go there."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.setFormatter(_Detailed())
        self.waiting: list[logging.LogRecord] = []
        self.file = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.file is None:
            self.waiting.append(record)
            return
        try:
            self.file.write(self.format(record) + "\n")
            self.file.flush()
        except Exception:
            self.handleError(record)

    def open(self, path: pathlib.Path) -> None:
        self.close_file()
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open for the run; appended on resume)
        for record in self.waiting:
            self.emit(record)
        self.waiting.clear()

    def close_file(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class _NoWidth:
    """stderr on a terminal that reports 0 columns (some CI runners' and tools' pseudo-terminals): no bar can be
    drawn in no width, so the stream says it is no terminal and a run prints plain progress lines instead."""

    def __init__(self, stream):
        self._stream = stream

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _no_width(stream) -> bool:
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns == 0
    except (OSError, ValueError, AttributeError):  # (a stream with no file descriptor, or a closed one)
        return False


@contextlib.contextmanager
def console():
    """While the command runs: warnings as `slide-train: warning: ...` lines (each distinct one once), and
    everything the logger hears kept for the run's log.txt. A terminal of no width is shown no bars."""
    stderr = sys.stderr
    if _no_width(stderr):
        sys.stderr = _NoWidth(stderr)
    log = logger()
    screen = _Console()
    screen.setFormatter(_OneLine())
    screen.setLevel(logging.WARNING)
    run_file = _RunFile()
    previous = log.level, log.propagate
    log.addHandler(screen)
    log.addHandler(run_file)
    log.setLevel(logging.INFO)
    log.propagate = False
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = _show
        try:
            yield log
        finally:
            log.removeHandler(screen)
            log.removeHandler(run_file)
            run_file.close_file()
            log.setLevel(previous[0])
            log.propagate = previous[1]
            if isinstance(sys.stderr, _NoWidth):
                sys.stderr = stderr


def open_run_log(run_dir: str | pathlib.Path) -> pathlib.Path | None:
    """Send what the command line has logged, and will log, to `<run_dir>/log.txt` (nothing outside it)."""
    for handler in logger().handlers:
        if isinstance(handler, _RunFile):
            path = pathlib.Path(run_dir) / LOG_FILE
            handler.open(path)
            return path
    return None


def say(text: str, screen: bool = True) -> None:
    """A line for the user: on stdout (above a progress bar, if one shows), and in the run's log.txt; with
    `screen` False in log.txt only (what a bar on the terminal already shows). Of a data-parallel run, the first
    rank speaks for all."""
    if os.environ.get("RANK", "0") != "0":
        return
    if screen:
        tqdm.write(text, file=sys.stdout)
        sys.stdout.flush()
    for handler in logger().handlers:
        if isinstance(handler, _RunFile):
            handler.handle(logger().makeRecord(LOGGER, logging.INFO, "", 0, text, None, None))
