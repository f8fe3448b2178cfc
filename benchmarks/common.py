"""What every benchmark script shares: the packages on the import path, and the commit a result belongs to."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Run from a plain checkout (the device machine has no installed packages): import the sources, ahead of any
# installed copy but behind PYTHONPATH, so a run can put another version of one package first (run_gpu.sh compare).
_given = sum(1 for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry)
sys.path[1 + _given:1 + _given] = [str(p / "src") for p in sorted((ROOT / "packages").iterdir())
                                   if (p / "src").is_dir()]


def git_commit() -> str:
    """SLIDE_COMMIT when set (the device machine's copy has no .git), else the checkout's HEAD."""
    if os.environ.get("SLIDE_COMMIT"):
        return os.environ["SLIDE_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def timed(fn, runs: int = 5) -> float:
    """Median wall-clock seconds of `runs` calls of `fn` after one untimed call (host-side work)."""
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def header(benchmark: str) -> dict:
    """The fields every result file starts with: what made it, from which commit, when."""
    return {"benchmark": benchmark, "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write_result(doc: dict, out_dir: str | os.PathLike | None, name: str) -> pathlib.Path | None:
    """Print `doc` as JSON and, given `out_dir`, write it there as `name`."""
    text = json.dumps(doc, indent=1) + "\n"
    print(text, end="", flush=True)
    if out_dir is None:
        return None
    path = pathlib.Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
