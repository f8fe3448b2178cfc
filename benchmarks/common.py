"""What every benchmark script shares: the packages on the import path, the commit a result belongs to, and the
versions and host a result was measured with."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import pathlib
import platform
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# Run from a plain checkout (a GPU machine may have nothing installed): import the sources, ahead of any installed
# copy but behind PYTHONPATH, so a run can put another version of the packages first (run.py --baseline).
_given = sum(1 for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry)
sys.path[1 + _given:1 + _given] = [str(p / "src") for p in sorted((ROOT / "packages").iterdir())
                                   if (p / "src").is_dir()]


def git_commit() -> str:
    """SLIDE_COMMIT when set (a copy of the checkout without .git), else the checkout's HEAD."""
    if os.environ.get("SLIDE_COMMIT"):
        return os.environ["SLIDE_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def versions() -> dict[str, str | None]:
    """Installed versions of what the figures depend on (None: not importable here)."""
    out = {}
    for dist in ("torch", "triton", "transformers", "liger-kernel", "kvikio"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    if out["kvikio"] is None:  # its wheels are named by CUDA version (kvikio-cu13)
        for dist in importlib.metadata.distributions():
            if (dist.metadata["Name"] or "").lower().startswith("kvikio"):
                out["kvikio"] = dist.version
                break
    return out


def host() -> dict:
    """The host's cores and memory, from /proc (no CUDA call: the orchestrating process never touches the GPU)."""
    mem_gib = None
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {"cores": os.cpu_count(), "memory_gib": mem_gib, "machine": platform.machine()}


def rss_gib() -> float:
    """Resident set size of this process now."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def register_shape(base: str, layers: int) -> str:
    """The preset `base`'s shape at another depth, as a preset of this process (random weights, as every
    benchmark's); its name."""
    from slide_train.models.presets import PRESETS

    name = f"{base}-{layers}-layers"
    PRESETS[name] = {**PRESETS[base], "num_hidden_layers": layers}
    return name
