"""The GPU machine's benchmark sweep: GPU tests and run.py suites as an ordered list of steps, each measured once
per version of the code, as many as fit one sitting's time. Its state is `results/sweep.json`.

    python3 benchmarks/sweep.py --list [--budget-s 540]     # the plan: what is measured, what is left
    python3 benchmarks/sweep.py --budget-s 540 --wheels .whl --export DIR
    python3 benchmarks/sweep.py --quick --budget-s 540 --export DIR   # the headline figures (QUICK), two sittings
    python3 benchmarks/sweep.py --only b3-none              # one step, measured or not
    python3 benchmarks/sweep.py --pack-baseline             # where git is: the baseline engine into build/baseline
    python3 benchmarks/sweep.py --fetch-wheels .whl         # where pip reaches an index: the wheels (WHEELS)

A step is measured when its latest result carries the version of what the step runs as it is now (`step_paths`:
the packages it imports and the harness files it runs, hashed from the files themselves): a change elsewhere leaves
it measured, and its earlier result stays listed with its commit until it is measured again.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fnmatch
import hashlib
import io
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable

# The engine the acceptance comparisons run against (the last commit before the parts owned their state), unpacked by
# --pack-baseline into BASELINE_DIR (ignored by git, so it reaches the GPU machine only when named in what the sitting
# copies over).
BASELINE = "3e635ee"
BASELINE_DIR = "build/baseline"
VS_BASELINE = f"--baseline {BASELINE_DIR} --baseline-name {BASELINE}"
# What one step may take, setup included: a sitting runs at most 600 s and the sweep's own checks take some of it.
STEP_LIMIT_S = 480.0
# The plain peer of the OLMoE shape: fp32 weights, gradients and AdamW moments of 6.9 B parameters are 103 GiB before
# activations, more than an H100's 80 GB; an H200 (141 GB) holds them.
MOE_PEER = dict(gpu_gib=120.0, why="the plain peer keeps fp32 weights, gradients and AdamW moments of 6.9 B "
                                   "parameters (103 GiB) on the GPU, before activations")

# The steps, most important first. `run`: commands in order, each "pytest PACKAGE" (its tests marked gpu) or
# "run.py ARGS" (benchmarks/run.py), or a dict with `cmd` and the GPU memory it needs (`gpu_gib`, `why`): on a
# smaller GPU that command is recorded as not fitting instead of run. `estimate_s`: the wall time assumed until the
# step has been measured. `fresh_host`: only as a sitting's first step on a host nothing has run on yet. `alone`: the
# only step of its sitting (nothing ran before it, nothing runs after it).
STEPS = [
    # one pytest per package: each tests/ folder has its own conftest
    {"name": "gpu-tests-kernels", "estimate_s": 150, "run": ["pytest slide-kernels"]},
    {"name": "gpu-tests-memory", "estimate_s": 60, "run": ["pytest slide-memory"]},
    {"name": "gpu-tests-io", "estimate_s": 60, "run": ["pytest slide-io"]},
    {"name": "gpu-tests-scheduler", "estimate_s": 150, "run": ["pytest slide-scheduler"]},
    {"name": "gpu-tests-train", "estimate_s": 360, "run": ["pytest slide-train"]},
    # this GPU's attention and routed-experts rates: every run after it plans with those its machine file lacks
    {"name": "gpu-rates", "estimate_s": 90, "run": ["run.py gpu-rates"]},
    # Against the baseline engine, old and new adjacent per clip mode and in the order old, new, new, old over each
    # bench's two steps, so a drift of the machine touches both alike. B3's Liger peer runs in the same steps: b3.json
    # then compares only figures that one step measured together (a later step's Slide figures would replace them).
    # Every command names the baseline, so run.py sees one config and merges the steps' figures into one file.
    {"name": "b3-none", "estimate_s": 240, "run": [f"run.py b3 --systems baseline --modes none {VS_BASELINE}",
                                                   f"run.py b3 --systems slide,liger --modes none {VS_BASELINE}"]},
    {"name": "b3-clip", "estimate_s": 240, "run": [f"run.py b3 --systems slide,baseline,liger --modes 1.0 "
                                                   f"{VS_BASELINE}"]},
    {"name": "b8-none", "estimate_s": 260, "run": [f"run.py b8 --systems baseline --modes none {VS_BASELINE}",
                                                   f"run.py b8 --systems slide --modes none {VS_BASELINE}"]},
    {"name": "b8-clip", "estimate_s": 260, "run": [f"run.py b8 --systems slide,baseline --modes 1.0 {VS_BASELINE}"]},
    # against the Liger peer
    {"name": "b1-liger", "estimate_s": 200, "run": ["run.py b1 --systems slide,liger --modes none,1.0"]},
    {"name": "b3-documents-liger", "estimate_s": 360,
     "run": ["run.py b3 --data documents --systems slide,liger --modes none,1.0"]},
    # the mixture of experts against the plain HF peer (Liger's patches are Llama's); at 256k tokens per step one
    # clip mode per step, to stay under the step limit
    {"name": "moe", "estimate_s": 360, "run": ["run.py moe --systems slide --modes none,1.0",
                                               {"cmd": "run.py moe --systems plain --modes none,1.0", **MOE_PEER}]},
    {"name": "moe-256k-clip", "estimate_s": 400, "run": ["run.py moe-256k --systems slide --modes 1.0",
                                                         {"cmd": "run.py moe-256k --systems plain --modes 1.0",
                                                          **MOE_PEER}]},
    {"name": "moe-256k-none", "estimate_s": 400, "run": ["run.py moe-256k --systems slide --modes none",
                                                         {"cmd": "run.py moe-256k --systems plain --modes none",
                                                          **MOE_PEER}]},
    # the peers are recorded as not fitting by run.py itself (no process trains them)
    {"name": "gemma2", "estimate_s": 360, "run": ["run.py gemma2 --systems slide,plain --modes none,1.0"]},
    # the attention backends at Gemma-2-9B's shape (flash-attn-4 where its wheels are installed)
    {"name": "attention", "estimate_s": 180, "run": ["run.py attention"]},
    {"name": "gemma3", "estimate_s": 360, "run": ["run.py gemma3 --systems slide --modes none,1.0"]},
    {"name": "moe-96k", "estimate_s": 300, "run": ["run.py moe-96k --systems slide --modes none,1.0"]},
    # Long sequences (run.py long), one clip mode and one row length a step: a process of 8B may take 2 min to set
    # up, then 3 steps of 45-90 s at 131,072 tokens. Each longest run has a sitting of its own (run.py plans its rows to
    # fit one), and the peer's ladder of lengths stops at its first run out of memory.
    # The 32k and 128k rows of a mode run in one worker process (its setup once): 120 s, then 3 steps of about 28 s
    # and 3 of about 56 s.
    {"name": "long-8b-clip", "estimate_s": 460, "run": ["run.py long --variants 8b-32k,8b-128k --modes 1.0"]},
    {"name": "long-8b-none", "estimate_s": 460, "run": ["run.py long --variants 8b-32k,8b-128k --modes none"]},
    {"name": "long-8b-longest-clip", "estimate_s": 480, "alone": True,
     "run": ["run.py long --variants 8b-longest --modes 1.0"]},
    {"name": "long-8b-longest-none", "estimate_s": 480, "alone": True,
     "run": ["run.py long --variants 8b-longest --modes none"]},
    {"name": "long-3b-longest", "estimate_s": 480, "alone": True,
     "run": ["run.py long --variants 3b-longest --modes 1.0"]},
    {"name": "long-peer", "estimate_s": 450, "run": ["run.py long --variants peer --systems liger"]},
    # the NVMe tier against RAM (in one piece it took about 700 s): B3, then B8 with the share `auto` picks on a
    # 64 GiB host; each part measures the disk under --work first
    {"name": "nvme-b3", "estimate_s": 360, "run": ["run.py nvme --variants b3-ram,b3-disk --warmup 2 --steps 3"]},
    {"name": "nvme-b3-grads", "estimate_s": 300, "run": ["run.py nvme --variants b3-ram,b3-disk-grads --warmup 2 "
                                                        "--steps 3"]},
    {"name": "nvme-b3-two-folders", "estimate_s": 300,
     "run": ["run.py nvme --variants b3-disk,b3-disk-two-folders --warmup 2 --steps 3"]},
    {"name": "nvme-b8", "estimate_s": 420,
     "run": ["run.py nvme --variants b8-ram,b8-disk-auto-host-64gib --warmup 2 --steps 3"]},
    {"name": "largest", "estimate_s": 450, "run": ["run.py largest"]},
    # the machine file's figures: host memory, PCIe and disk as a fresh host has them, before any run fills caches
    {"name": "probe", "estimate_s": 120, "run": ["run.py probe"], "fresh_host": True},
]

# The headline figures in at most two sittings (`--quick`): B3 clipped beside its Liger peer, B8 unclipped and
# clipped, Gemma 2 and OLMoE unclipped, and 8B at 131,072 tokens clipped (a sitting to itself). A step of over 2 s
# runs one warm-up and three timed steps (B3's 1.8 s keeps the suites' 2 and 5). The figures go into the suites'
# files beside the full sweep's; the estimates are the processes' wall times in those files (setup and each step).
QUICK_SITTING_S = 540.0
FEW = "--warmup 1 --steps 3"
QUICK = [
    {"name": "quick-b3-clip", "estimate_s": 110, "run": ["run.py b3 --systems slide,liger --modes 1.0"]},
    {"name": "quick-b8", "estimate_s": 205, "run": [f"run.py b8 --systems slide --modes none,1.0 {FEW}"]},
    {"name": "quick-gemma2-none", "estimate_s": 110, "run": [f"run.py gemma2 --systems slide --modes none {FEW}"]},
    {"name": "quick-moe-none", "estimate_s": 85, "run": [f"run.py moe --systems slide --modes none {FEW}"]},
    {"name": "quick-long-8b-128k-clip", "estimate_s": 420, "alone": True,
     "run": [f"run.py long --variants 8b-128k --modes 1.0 {FEW}"]},
]
# What a sitting spends before its first step: installing the wheels, checking the environment
SETUP_S = 30.0

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "sweep.json"
PACKAGES = ("slide-kernels", "slide-memory", "slide-io", "slide-scheduler", "slide-train")
# Wheels the GPU machine's image may lack, pinned (`--fetch-wheels DIR` downloads them where an index is reachable).
# A sitting installs from --wheels only those the image lacks, so none shadows the image's own copy.
WHEELS = {
    "datasets": "5.2.0",  # slide-train's data sources (gpu-tests-train), and what it needs beyond the image's
    "dill": "0.4.1",  # (pyarrow, pandas, fsspec, huggingface-hub, ...)
    "multiprocess": "0.70.19",
    "xxhash": "4.1.0",
    "liger-kernel": "0.8.5",  # the plain peer's kernels (b1, b3, long-peer)
    "kvikio-cu13": "26.10.0",  # the NVMe tier's store through kvikio (the image has cupy and the CUDA toolkit)
    "libkvikio-cu13": "26.10.0",
    "rapids-logger": "0.3.0",
    "pytest": "9.2.0",  # a bare image's test runner
    "pluggy": "1.7.0",
    "iniconfig": "2.3.1",
}
# flash-attn-4 (an optional attention backend) and its CuTe DSL, which the image lacks: the DSL's Python is in
# libs-core, its CUDA 13 libraries (the image's torch is cu130) in libs-cu13, a wheel larger than one transfer to the
# GPU machine; `--fetch-wheels` cuts such wheels into parts that travel in separate runs (`parts_dirs`), and a
# sitting joins them once every part has arrived (`gather_parts`).
FA4_WHEELS = {
    "flash-attn-4": "4.0.0b36",
    "nvidia-cutlass-dsl": "4.8.1",  # (its .pth puts the DSL's packages on the path: `site_hook`)
    "nvidia-cutlass-dsl-libs-base": "4.8.1",
    "nvidia-cutlass-dsl-libs-core": "4.8.1",
    "nvidia-cutlass-dsl-libs-cu13": "4.8.1",
    "cuda-bindings": "13.5.0",
    "cuda-pathfinder": "1.5.0",
    "quack-kernels": "0.6.5",
    "apache-tvm-ffi": "0.1.15.post2",
    "torch-c-dlpack-ext": "0.1.5",
    "einops": "0.8.2",
}
WHEELS.update(FA4_WHEELS)
# The largest part of a wheel: two parts, or the other wheels and one part, travel with the working tree in one
# run (the limit is 64 MiB)
PART_BYTES = 30 << 20
# Where a sitting keeps the parts of a large wheel between runs on a warm GPU machine, and the wheels it joined
WHEEL_STAGE = pathlib.Path(tempfile.gettempdir()) / "slide-sweep-stage"
# The GPU machine's Python and platform, as pip download names them
WHEEL_TARGET = ("--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64")
WHEEL_SITE = pathlib.Path(tempfile.gettempdir()) / "slide-sweep-site"
# Left by the first step a host runs: a host that has it is no longer fresh (the GPU machine keeps /tmp while warm).
HOST_USED = pathlib.Path(tempfile.gettempdir()) / "slide-sweep.host-used"
# The code whose version a sitting records; results/ is what the sweep writes, not what it measures.
TREE_PATHS = ("packages", "benchmarks")
# What a step's result depends on (step_paths): run.py's files, a suite's own, the package run.py trains through
# (with the packages it needs), and the root's pytest settings for a GPU test
HARNESS_FILES = ("benchmarks/run.py", "benchmarks/worker.py", "benchmarks/common.py", "benchmarks/tables.py")
SUITE_FILES = {"kernels": ("benchmarks/kernel_bench.py",), "plans": ("docs/machines",)}
RUNS_THROUGH = "slide-train"
PYTEST_FILES = ("pyproject.toml",)
TREE_SKIPS = ("benchmarks/results",)
GRACE_S = 20.0  # after an interrupt, before a step's processes are killed outright
TAIL_LINES = 30


@dataclasses.dataclass(frozen=True)
class Command:
    text: str  # as the table has it: "pytest PACKAGE" or "run.py ARGS"
    gpu_gib: float | None = None  # GPU memory it needs; None: any GPU
    why: str = ""

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text)

    def suites(self) -> list[str]:
        """The run.py suites it names (its arguments before the first option)."""
        if self.words[0] != "run.py":
            return []
        suites = []
        for word in self.words[1:]:
            if word.startswith("-"):
                break
            suites.append(word)
        return suites

    def systems(self) -> list[str]:
        """The systems a run.py command names with --systems (none named: none checked)."""
        words = self.words
        given = next((words[i + 1] for i, w in enumerate(words[:-1]) if w == "--systems"), "")
        return [s for s in given.split(",") if s]

    def uses_baseline(self) -> bool:
        return "--baseline" in self.words

    def argv(self, python: str) -> list[str]:
        head, *rest = self.words
        if head == "run.py":
            return [python, str(HERE / "run.py"), *rest]
        if head == "pytest":
            (package,) = rest
            return [python, "-m", "pytest", "-m", "gpu", "-q", f"packages/{package}/tests"]
        raise ValueError(f"{self.text!r}: a command is 'run.py ARGS' or 'pytest PACKAGE'")


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    estimate_s: float  # assumed until measured
    commands: tuple[Command, ...]
    fresh_host: bool = False
    alone: bool = False


def build_steps(table: list[dict]) -> list[Step]:
    steps = []
    for entry in table:
        commands = tuple(Command(c) if isinstance(c, str) else Command(c["cmd"], c.get("gpu_gib"), c.get("why", ""))
                         for c in entry["run"])
        steps.append(Step(entry["name"], float(entry["estimate_s"]), commands, entry.get("fresh_host", False),
                          entry.get("alone", False)))
    names = [s.name for s in steps]
    if len(set(names)) != len(names):
        raise ValueError(f"step names repeat: {names}")
    return steps


# --- which version of the code a result belongs to ---------------------------------------------------------------

def _git_object(kind: str, body: bytes) -> bytes:
    return hashlib.sha1(f"{kind} {len(body)}\0".encode() + body).digest()


def _tree_object(entries: list[tuple[str, str, bytes]]) -> bytes:
    # git orders a tree's entries by name, a folder's as if it ended in "/"
    entries = sorted(entries, key=lambda e: e[1].encode() + (b"/" if e[0] == "40000" else b""))
    return _git_object("tree", b"".join(f"{mode} {name}".encode() + b"\0" + oid for mode, name, oid in entries))


class Ignored:
    """The .gitignore rules (and .git/info/exclude) that decide which files travel with a checkout: plain names and
    globs at any depth, anchored paths, folder-only patterns; negations (`!`) are not read."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        self.rules: list[tuple[str, str, bool, bool]] = []  # (folder of the file, pattern, anchored, folders only)
        self.seen: set[pathlib.Path] = set()  # (each .gitignore read once, however many folders are hashed)
        for path in (root / ".git" / "info" / "exclude", root / ".gitignore"):
            self.read(path, "")

    def read(self, path: pathlib.Path, base: str) -> None:
        if path in self.seen or not path.is_file():
            return
        self.seen.add(path)
        for line in path.read_text(errors="replace").splitlines():
            line = line.rstrip()
            if not line or line.startswith(("#", "!")):
                continue
            folders_only = line.endswith("/")
            line = line.rstrip("/")
            anchored = "/" in line
            self.rules.append((base, line.lstrip("/"), anchored, folders_only))

    def __call__(self, rel: str, is_folder: bool) -> bool:
        for base, pattern, anchored, folders_only in self.rules:
            if folders_only and not is_folder:
                continue
            if base:
                if not rel.startswith(base + "/"):
                    continue
                inner = rel[len(base) + 1:]
            else:
                inner = rel
            if fnmatch.fnmatchcase(inner if anchored else inner.rsplit("/", 1)[-1], pattern):
                return True
        return False


def _folder_id(root: pathlib.Path, rel: str, ignored: Ignored) -> bytes | None:
    """git's tree id of the folder `rel` as its files are now (None: nothing in it that git would keep)."""
    folder = root / rel
    ignored.read(folder / ".gitignore", rel)
    entries = []
    for child in sorted(os.scandir(folder), key=lambda e: e.name):
        path = f"{rel}/{child.name}"
        if child.name == ".git" or path in TREE_SKIPS:
            continue
        if child.is_symlink():
            if not ignored(path, False):
                entries.append(("120000", child.name, _git_object("blob", os.readlink(child.path).encode())))
        elif child.is_dir():
            if not ignored(path, True):
                sub = _folder_id(root, path, ignored)
                if sub is not None:
                    entries.append(("40000", child.name, sub))
        elif child.is_file() and not ignored(path, False):
            mode = "100755" if os.access(child.path, os.X_OK) else "100644"
            entries.append((mode, child.name, _git_object("blob", pathlib.Path(child.path).read_bytes())))
    return _tree_object(entries) if entries else None


def folder_id(root: pathlib.Path, rel: str) -> str:
    """git's tree id of one folder of the working tree: `git rev-parse HEAD:REL` where it is clean and has no
    untracked files that git would keep."""
    oid = _folder_id(root, rel, Ignored(root))
    return oid.hex() if oid else ""


def tree_hash(root: pathlib.Path = ROOT) -> str:
    """The version of the code a result belongs to: git's id of a tree holding TREE_PATHS (less TREE_SKIPS) as the
    working tree has them, computed from the files themselves. So it needs no git and no .git (the GPU machine gets a
    copy of the files without it), a dirty tree has its own hash, and a commit elsewhere leaves it unchanged."""
    ignored = Ignored(root)
    entries = []
    for rel in TREE_PATHS:
        if (root / rel).is_dir():
            oid = _folder_id(root, rel, ignored)
            if oid is not None:
                entries.append(("40000", rel, oid))
    return _tree_object(entries).hex()


class Code:
    """git's ids of the working tree's files and folders (each read once), and the version of a step's code: a hash
    of the ids of the paths it runs (`step_paths`)."""

    def __init__(self, root: pathlib.Path = ROOT):
        self.root, self.ignored, self.ids = root, Ignored(root), {}

    def id(self, rel: str) -> str:
        if rel not in self.ids:
            parts = rel.split("/")
            for i in range(1, len(parts)):  # (the .gitignore files of the folders above it)
                self.ignored.read(self.root.joinpath(*parts[:i], ".gitignore"), "/".join(parts[:i]))
            path = self.root / rel
            if path.is_dir():
                oid = _folder_id(self.root, rel, self.ignored)
            elif path.is_file() and not self.ignored(rel, False):
                oid = _git_object("blob", path.read_bytes())
            else:
                oid = None
            self.ids[rel] = oid.hex() if oid else ""
        return self.ids[rel]

    def version(self, paths: list[str]) -> str:
        return hashlib.sha1("".join(f"{rel}\0{self.id(rel)}\n" for rel in sorted(paths)).encode()).hexdigest()


def package_needs(root: pathlib.Path, package: str) -> list[str]:
    """`package` and the sibling packages it depends on, directly or not, as their pyproject.toml files declare."""
    import tomllib

    needs, todo = [], [package]
    while todo:
        name = todo.pop()
        if name in needs or not (root / "packages" / name).is_dir():
            continue
        needs.append(name)
        pyproject = root / "packages" / name / "pyproject.toml"
        declared = tomllib.loads(pyproject.read_text()).get("project", {}).get("dependencies", []) \
            if pyproject.is_file() else []
        todo += [dist_name(re.match(r"[A-Za-z0-9_.-]+", d).group()) for d in declared]
    return sorted(needs)


def step_paths(step: Step, root: pathlib.Path = ROOT) -> list[str]:
    """What a step runs, whose change makes its result stale: a GPU test its package's folder (sources, tests,
    conftest), the sources of the packages it needs and the root's pytest settings; a run.py command the harness
    files, its suite's own, and the sources of the packages slide-train needs (run.py's workers train through it)."""
    paths: set[str] = set()
    for command in step.commands:
        if command.words[0] == "pytest":
            package = command.words[1]
            paths |= {f"packages/{package}", *PYTEST_FILES}
            paths |= {f"packages/{p}/src" for p in package_needs(root, package) if p != package}
        else:
            paths |= {f"packages/{p}/src" for p in package_needs(root, RUNS_THROUGH)} | set(HARNESS_FILES)
            for suite in command.suites():
                paths |= set(SUITE_FILES.get(suite, ()))
    return sorted(paths)


def step_versions(steps: list[Step], root: pathlib.Path = ROOT) -> dict[str, str]:
    code = Code(root)
    return {step.name: code.version(step_paths(step, root)) for step in steps}


def git_state(root: pathlib.Path = ROOT) -> dict:
    """The commit (SLIDE_COMMIT where set: a copy without .git cannot say) and whether TREE_PATHS differ from it;
    informative only: whether a step is measured goes by the tree hash."""
    state: dict = {"commit": os.environ.get("SLIDE_COMMIT"), "dirty": None}
    try:
        head = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=root, text=True,
                                       stderr=subprocess.DEVNULL).strip()
        changed = subprocess.check_output(["git", "status", "--porcelain", "--", *TREE_PATHS,
                                           *(f":(exclude){p}" for p in TREE_SKIPS)], cwd=root, text=True,
                                          stderr=subprocess.DEVNULL)
    except (OSError, subprocess.CalledProcessError):
        return state
    state["commit"] = state["commit"] or head
    state["dirty"] = bool(changed.strip())
    return state


# --- results -----------------------------------------------------------------------------------------------------

def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class Results:
    """sweep.json: the latest sitting's environment and each step's latest result, rewritten whole after each step."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.doc = json.loads(path.read_text()) if path.is_file() else {}
        self.doc.setdefault("steps", {})

    def get(self, name: str) -> dict | None:
        return self.doc["steps"].get(name)

    def put(self, name: str, result: dict) -> None:
        self.doc["steps"][name] = result
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1) + "\n")
        os.replace(tmp, self.path)  # (a kill mid-write leaves the previous file whole)


def timed(result: dict | None) -> bool:
    """Whether a result's wall time measured the step (a skipped one ran nothing)."""
    return bool(result) and result.get("wall_s") is not None and result["status"] not in ("skipped", "does not fit")


def estimate_s(step: Step, result: dict | None) -> float:
    """The step's last measured wall time, else the table's. A step stopped at a budget's end ran longer than
    its wall time: a quarter more each time, until it fits or is seen to need splitting."""
    if not timed(result):
        return step.estimate_s
    if result.get("stopped"):
        return round(result["wall_s"] * 1.25, 1)
    if result["status"] == "partial":  # (a part that needs a larger GPU did not run)
        return max(result["wall_s"], step.estimate_s)
    return result["wall_s"]


def pending_why(step: Step, result: dict | None, code: str, gpu_gib: float | None, retry_failed: bool = False
                ) -> str | None:
    """Why the step still has to run for this version of its code (None: measured)."""
    if result is None:
        return "never run"
    if result.get("code") != code:  # (a result older than per-step versions has none: measured again)
        return f"measured on {result.get('commit') or 'an unknown commit'}, whose code of this step differs"
    if result.get("stopped"):
        return "stopped at a budget's end"
    status = result["status"]
    if status == "skipped":
        return f"skipped: {result.get('reason')}"
    if status == "failed" and retry_failed:
        return "failed"
    if status in ("partial", "does not fit") and gpu_gib is not None:
        needs = max((c.gpu_gib or 0.0) for c in step.commands)
        if result.get("gpu_gib") is not None and result["gpu_gib"] < needs <= gpu_gib:
            return f"parts need {needs:.0f} GiB of GPU memory, which this GPU has"
    return None


# --- running steps -----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Outcome:
    returncode: int
    stopped: bool = False  # killed at the budget's end
    tail: list[str] = dataclasses.field(default_factory=list)


Runner = Callable[[Step, Command, "float | None"], Outcome]


@dataclasses.dataclass
class Context:
    """What the sweep knows about this sitting: the code's version and the machine."""

    tree: str
    git: dict
    env: dict  # from check_environment (gpu, gpu_gib, versions, disk)
    suites: set[str]  # what run.py offers
    baseline_problem: str | None  # why --baseline steps cannot run, or None
    host_fresh: bool
    code: dict[str, str] = dataclasses.field(default_factory=dict)  # each step's version (step_versions)
    machine: str | None = None  # the machine file the runs plan with ($SLIDE_MACHINE; None: this host's probe)

    def version(self, step: Step) -> str:
        return self.code.get(step.name) or self.tree


class ProcessRunner:
    """Runs a command in a process group of its own, its output streamed to stdout and the log; at the deadline it is
    interrupted (run.py then kills its worker, whose group is its own) and killed after GRACE_S."""

    def __init__(self, env: dict[str, str], log: pathlib.Path | None = None):
        self.env, self.log = env, log

    def __call__(self, step: Step, command: Command, deadline_s: float | None) -> Outcome:
        tail: deque[str] = deque(maxlen=TAIL_LINES)
        log = self.log.open("a") if self.log else None
        proc = subprocess.Popen(command.argv(sys.executable), cwd=ROOT, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)

        def pump() -> None:
            for line in proc.stdout:
                print(line, end="", flush=True)
                if log:
                    log.write(line)
                    log.flush()
                tail.append(line.rstrip()[:300])

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        stopped = False
        try:
            try:
                proc.wait(timeout=deadline_s)
            except subprocess.TimeoutExpired:
                stopped = True
                self.stop(proc)
        except KeyboardInterrupt:
            self.stop(proc)
            raise
        finally:
            reader.join(timeout=5)
            if log:
                log.close()
        return Outcome(proc.returncode, stopped, list(tail))

    @staticmethod
    def stop(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass


def why_not_run(step: Step, ctx: Context) -> str | None:
    """A reason the step cannot run here at all, recorded as skipped (it stays queued). A peer or test runner that
    does not import would leave a step measured without its point, so a missing wheel skips the step."""
    versions = ctx.env.get("versions", {})  # (empty until the environment is checked: --list assumes all there)
    for command in step.commands:
        missing = [s for s in command.suites() if s not in ctx.suites]
        if missing:
            return f"suite not available: run.py has no {', '.join(missing)}"
        if command.uses_baseline() and ctx.baseline_problem:
            return ctx.baseline_problem
        if "liger" in command.systems() and versions.get("liger-kernel", "") is None:
            return "liger-kernel is not installed: bring its wheel (--wheels)"
        if command.words[0] == "pytest" and versions.get("pytest", "") is None:
            return "pytest is not installed: bring its wheels (pytest, pluggy, iniconfig)"
    return None


class Sweep:
    def __init__(self, steps: list[Step], results: Results, ctx: Context, runner: Runner,
                 clock: Callable[[], float] = time.monotonic, after_step: Callable[[], None] = lambda: None,
                 mark_host_used: Callable[[], None] = lambda: None, retry_failed: bool = False,
                 say: Callable[[str], None] = print):
        self.steps, self.results, self.ctx, self.runner, self.clock = steps, results, ctx, runner, clock
        self.after_step, self.mark_host_used = after_step, mark_host_used
        self.retry_failed, self.say = retry_failed, say
        self.ran: list[str] = []  # steps this sitting ran or recorded, in order
        self.executed: list[Step] = []  # of those, the ones that ran commands (not recorded as skipped)

    def pending(self) -> list[Step]:
        return [s for s in self.steps if pending_why(s, self.results.get(s.name), self.ctx.version(s),
                                                     self.ctx.env.get("gpu_gib"), self.retry_failed)]

    def estimate(self, step: Step) -> float:
        return estimate_s(step, self.results.get(step.name))

    def choose(self, steps: list[Step], budget_s: float | None) -> list[Step]:
        """The steps a budget would run by their estimates, most important first, a step that does not fit passed
        over for smaller ones after it; a fresh-host step (only while the host is fresh) goes first. A step that
        runs alone is chosen only as the first that runs, and ends the choice."""
        chosen, left = [], budget_s
        fresh_first = self.ctx.host_fresh and any(s.fresh_host for s in steps)  # (a fresh-host step goes first)
        for step in steps:
            if step.fresh_host and not self.ctx.host_fresh:
                continue
            runs = why_not_run(step, self.ctx) is None
            if step.alone and runs and (fresh_first or any(why_not_run(c, self.ctx) is None for c in chosen)):
                continue
            cost = self.estimate(step) if runs else 0.0
            if left is None or cost <= left:
                chosen.append(step)
                left = None if left is None else left - cost
                if step.alone and runs:
                    break
        return sorted(chosen, key=lambda s: not s.fresh_host)  # (stable: importance otherwise)

    def sittings(self, steps: list[Step], budget_s: float) -> tuple[list[list[Step]], list[Step]]:
        """The sittings of `budget_s` (SETUP_S of it for the sitting's checks) that `steps` take by their estimates,
        each filled as `choose` fills it; and the steps no sitting holds (an estimate over the budget). Steps that
        cannot run here take none."""
        left, plan, fresh = [s for s in steps if not why_not_run(s, self.ctx)], [], self.ctx.host_fresh
        try:
            while left:
                chosen = self.choose(left, budget_s - SETUP_S)
                if not chosen:
                    break
                plan.append(chosen)
                left = [s for s in left if s not in chosen]
                self.ctx.host_fresh = False  # (only the first sitting may find the host fresh)
        finally:
            self.ctx.host_fresh = fresh
        return plan, left

    def run(self, budget_s: float | None, start: float, only: Step | None = None) -> None:
        """Runs steps until none fits what is left of `budget_s` (counted from `start`, the sitting's checks
        included), writing each result as it comes."""
        queue = [only] if only else self.pending()
        first = self.choose(queue, None if budget_s is None else budget_s - (self.clock() - start))
        order = first + [s for s in queue if s not in first]  # (steps that run short leave room for more)
        while True:
            left = None if budget_s is None else budget_s - (self.clock() - start)
            step = next((s for s in order if s.name not in self.ran and (only or self.may_start(s, left))), None)
            if step is None:
                return
            self.ran.append(step.name)
            self.run_step(step, left)

    def may_start(self, step: Step, left: float | None) -> bool:
        if why_not_run(step, self.ctx):
            return True  # (recorded as skipped: takes no time)
        if step.fresh_host and not self.ctx.host_fresh:
            return False
        if any(s.alone for s in self.executed) or (step.alone and self.executed):
            return False  # (a step that runs alone has the sitting to itself)
        return left is None or self.estimate(step) <= left

    def run_step(self, step: Step, left: float | None) -> None:
        base = {"code": self.ctx.version(step), "tree": self.ctx.tree, **self.ctx.git, "date": now(),
                "gpu": self.ctx.env.get("gpu"), "gpu_gib": self.ctx.env.get("gpu_gib"),
                "machine_file": self.ctx.machine or "this host's probe"}
        reason = why_not_run(step, self.ctx)
        if reason:
            self.say(f"== {step.name}: skipped ({reason})")
            self.results.put(step.name, {**base, "status": "skipped", "reason": reason})
            self.after_step()
            return
        self.say(f"== {step.name}: estimate {self.estimate(step):.0f} s"
                 + ("" if left is None else f", {left:.0f} s left"))
        self.ctx.host_fresh = False
        self.mark_host_used()
        self.executed.append(step)
        began = self.clock()
        parts, tail, stopped = [], [], False
        for command in step.commands:
            gpu_gib = self.ctx.env.get("gpu_gib")
            if command.gpu_gib and (gpu_gib is None or gpu_gib < command.gpu_gib):
                reason = (f"does not fit: needs a GPU of {command.gpu_gib:.0f} GiB or more ({command.why}); "
                          f"this {self.ctx.env.get('gpu')} has {gpu_gib} GiB")
                self.say(f"   {command.text}: {reason}")
                parts.append({"command": command.text, "status": "does not fit", "reason": reason})
                continue
            deadline = None if left is None else left - (self.clock() - began)
            if stopped or (deadline is not None and deadline <= 0):
                parts.append({"command": command.text, "status": "not run", "reason": "the budget ran out"})
                stopped = True
                continue
            self.say(f"-- {command.text}")
            t0 = self.clock()
            out = self.runner(step, command, deadline)
            ok = out.returncode == 0 or (command.words[0] == "pytest" and out.returncode == 5)  # (5: none marked gpu)
            part = {"command": command.text, "status": "ok" if ok and not out.stopped else "failed",
                    "returncode": out.returncode, "wall_s": round(self.clock() - t0, 1)}
            if out.stopped:
                part["reason"] = "stopped at the budget's end"
                stopped = True
            parts.append(part)
            tail = out.tail
        ran = [p for p in parts if p["status"] != "does not fit"]
        if not ran:
            status = "does not fit"
        elif any(p["status"] != "ok" for p in ran):
            status = "failed"
        else:
            status = "partial" if len(ran) < len(parts) else "ok"
        result = {**base, "status": status, "wall_s": round(self.clock() - began, 1), "commands": parts,
                  "tail": tail}
        if stopped:
            result["stopped"] = True
        self.results.put(step.name, result)
        self.say(f"== {step.name}: {status} in {result['wall_s']:.0f} s")
        self.after_step()

    def describe(self, steps: list[Step]) -> list[str]:
        """One line per step: its estimate and where it stands for this tree."""
        lines = []
        for i, step in enumerate(steps, 1):
            result = self.results.get(step.name)
            why = pending_why(step, result, self.ctx.version(step), self.ctx.env.get("gpu_gib"), self.retry_failed)
            if why is None:
                state = f"measured: {result['status']}" + (f" on {result['gpu']}" if result.get("gpu") else "") \
                    + (f" at {result['commit']}" if result.get("commit") else "")
            else:
                state = why
                if result and result.get("status"):  # (an earlier version's figure stays listed)
                    state += f" (then: {result['status']}" + (f" on {result['gpu']}" if result.get("gpu") else "") \
                        + ")"
                blocked = why_not_run(step, self.ctx)
                if blocked and not why.endswith(blocked):
                    state += f"; here it would be skipped: {blocked}"
                if step.fresh_host and not self.ctx.host_fresh:
                    state += "; waits for a fresh host"
                if step.alone:
                    state += "; runs alone in a sitting"
            est = self.estimate(step)
            over = "  over the step limit: split it" if est > STEP_LIMIT_S else ""
            lines.append(f"{i:3} {step.name:24} {est:6.0f} s{' ' if timed(result) else '*'}  {state}{over}")
        return lines


# --- the sitting's setup: wheels, environment, baseline ---------------------------------------------------------------

def dist_name(name: str) -> str:
    """A distribution's name as pip compares them (a wheel's file name has `_` where the project has `-`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_command(folder: pathlib.Path, name: str, version: str) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *WHEEL_TARGET,
            "-d", str(folder), f"{name}=={version}"]


def fetch_wheels(folder: pathlib.Path) -> None:
    """WHEELS downloaded into `folder` for the GPU machine (where an index is reachable), one by one; a wheel over
    PART_BYTES is cut into parts, each in a folder of its own beside `folder` (`parts_dirs`), so that the parts
    travel in runs of their own (two at a time) before the run that carries `folder` and the last part."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, version in WHEELS.items():
        command = wheel_command(folder, name, version)
        print(shlex.join(command[2:]), flush=True)
        if subprocess.run(command).returncode != 0:
            raise SystemExit(f"pip could not download {name}=={version} (its output above)")
    for wheel in sorted(folder.glob("*.whl")):
        if wheel.stat().st_size > PART_BYTES:
            split_wheel(wheel, parts_dirs(folder))
    for d in [folder, *parts_dirs(folder)]:
        if d.is_dir():
            size = sum(f.stat().st_size for f in d.iterdir())
            print(f"{d}: {len(list(d.iterdir()))} files, {size / 2**20:.1f} MiB (one run's carry each)")


def parts_dirs(folder: pathlib.Path, count: int = 4) -> list[pathlib.Path]:
    """The folders beside `folder` that hold the later parts of its large wheels: `<folder>-2`, `<folder>-3`..."""
    return [folder.with_name(f"{folder.name}-{i}") for i in range(2, count + 2)]


def split_wheel(wheel: pathlib.Path, folders: list[pathlib.Path]) -> list[pathlib.Path]:
    """`wheel` cut into parts of at most PART_BYTES (`<wheel>.part-I-of-N`), the I-th in `folders[I - 1]`; the
    wheel itself is removed."""
    data = wheel.read_bytes()
    pieces = [data[i:i + PART_BYTES] for i in range(0, len(data), PART_BYTES)]
    if len(pieces) > len(folders):
        raise SystemExit(f"{wheel.name} needs {len(pieces)} parts, more than the {len(folders)} folders for them")
    out = []
    for i, (piece, where) in enumerate(zip(pieces, folders)):
        where.mkdir(parents=True, exist_ok=True)
        out.append(where / f"{wheel.name}.part-{i + 1}-of-{len(pieces)}")
        out[-1].write_bytes(piece)
    wheel.unlink()
    return out


def gather_parts(folder: pathlib.Path, stage: pathlib.Path | None = None) -> list[pathlib.Path]:
    """The parts `folder` and the folders beside it carry, kept in `stage` (which a warm GPU machine keeps between
    runs), and every wheel whose parts have all arrived, joined there; returns the joined wheels (those of earlier
    runs too). `python3 benchmarks/sweep.py --gather-parts` in a run that carries some parts only keeps them."""
    stage = stage or WHEEL_STAGE
    stage.mkdir(parents=True, exist_ok=True)
    for where in [folder, *parts_dirs(folder)]:
        for part in where.glob("*.whl.part-*-of-*") if where.is_dir() else ():
            shutil.copyfile(part, stage / part.name)
    sets: dict[str, list[pathlib.Path]] = {}
    for part in stage.glob("*.whl.part-*-of-*"):
        sets.setdefault(part.name.split(".part-")[0], []).append(part)
    for name, parts in sets.items():
        total = int(parts[0].name.rsplit("-of-", 1)[1])
        if len(parts) == total and not (stage / name).exists():
            ordered = sorted(parts, key=lambda p: int(p.name.split(".part-")[1].split("-of-")[0]))
            with open(stage / name, "wb") as out:
                for part in ordered:
                    out.write(part.read_bytes())
    return sorted(stage.glob("*.whl"))


def site_hook(site: pathlib.Path) -> None:
    """A `sitecustomize` in `site` that reads its .pth files (as site-packages' are read; a folder on PYTHONPATH's
    are not): the CuTe DSL's .pth puts its packages on the path."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site)!r})\n")


def missing_here(names) -> list[str]:
    """Those of `names` this Python cannot find (the image lacks them)."""
    import importlib.metadata as md

    out = []
    for name in names:
        try:
            md.distribution(name)
        except md.PackageNotFoundError:
            out.append(name)
    return out


def install_wheels(folder: pathlib.Path) -> list[str]:
    """The WHEELS this Python lacks, installed from `folder` (no index, no dependencies: the image has those) into
    WHEEL_SITE; says which it lacks and `folder` has no wheel of."""
    present = {dist_name(w.name.split("-")[0]): w for w in [*folder.glob("*.whl"), *gather_parts(folder)]}
    lacking = missing_here(WHEELS)
    wanted = [name for name in lacking if name in present]
    absent = [name for name in lacking if name not in present]
    if absent:
        print(f"wheels: this image lacks {', '.join(absent)} and {folder} has none of them (`python "
              f"benchmarks/sweep.py --fetch-wheels {folder}` where pip reaches an index)", flush=True)
    if not wanted:
        return []
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-cache-dir",
                           "--no-compile", "--upgrade", "--target", str(WHEEL_SITE),
                           *(str(present[name]) for name in wanted)])
    if done.returncode != 0:
        raise SystemExit(f"installing {', '.join(wanted)} from {folder} failed (pip's output above)")
    site_hook(WHEEL_SITE)
    print(f"wheels: installed {', '.join(wanted)} from {folder}", flush=True)
    return wanted


# Run in a process of its own: the sweep itself never touches the GPU, so it holds none of its memory.
ENV_CHECK = """
import importlib.metadata as md, json, platform
out = {"python": platform.python_version(), "versions": {}}
for dist in ("torch", "triton", "transformers", "liger-kernel", "kvikio-cu13", "pytest", "datasets", "pyarrow",
             "huggingface-hub", "fsspec"):
    try:
        out["versions"][dist] = md.version(dist)
    except md.PackageNotFoundError:
        out["versions"][dist] = None
import torch
out["gpu"], out["gpu_gib"], out["gpus"] = None, None, torch.cuda.device_count()
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    out["gpu"], out["gpu_gib"] = p.name, round(p.total_memory / 2**30, 1)
print(json.dumps(out))
"""


def check_environment(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", ENV_CHECK], env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"the environment check failed:\n{out.stderr[-2000:]}")
    found = json.loads(out.stdout.strip().splitlines()[-1])
    found["disk_free_gib"] = {str(p): round(shutil.disk_usage(p).free / 2**30, 1)
                              for p in (ROOT, pathlib.Path(tempfile.gettempdir()))}
    try:
        meminfo = pathlib.Path("/proc/meminfo").read_text().splitlines()
        found["host_memory_gib"] = round(int(next(ln.split()[1] for ln in meminfo if ln.startswith("MemTotal:")))
                                         / 2**20, 1)
    except (OSError, StopIteration):
        found["host_memory_gib"] = None
    found["cores"] = os.cpu_count()
    found["date"] = now()
    return found


def baseline_problem(root: pathlib.Path = ROOT) -> str | None:
    folder = root / BASELINE_DIR
    hint = (f"run `python benchmarks/sweep.py --pack-baseline` where git is and copy {BASELINE_DIR} to the GPU "
            "machine")
    if not any((folder / "packages").glob("*/src")):
        return f"no baseline engine in {BASELINE_DIR}: {hint}"
    stamp = folder / "COMMIT"
    if stamp.is_file() and not stamp.read_text().strip().startswith(BASELINE):
        return f"{BASELINE_DIR} holds {stamp.read_text().strip()[:12]}, not {BASELINE}: {hint}"
    return None


def pack_baseline(root: pathlib.Path = ROOT) -> None:
    """git archive BASELINE's packages/ into BASELINE_DIR, with its commit in COMMIT."""
    folder = root / BASELINE_DIR
    commit = subprocess.check_output(["git", "rev-parse", f"{BASELINE}^{{commit}}"], cwd=root, text=True).strip()
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", commit, "packages"], cwd=root, check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    (folder / "COMMIT").write_text(commit + "\n")
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    print(f"{BASELINE_DIR}: packages/ of {commit[:12]} ({size / 2**20:.1f} MiB)")
    print(f"copy along: {BASELINE_DIR}   (with the wheels: {BASELINE_DIR} .whl)")


def export(folder: pathlib.Path, results: Results, since: float, suites: pathlib.Path = HERE / "results") -> None:
    """results.tar in `folder`: the sweep's state and every suite file (`suites`/*.json) this sitting wrote, to unpack
    into benchmarks/results where the sitting was made from."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "results.tar.tmp"
    with tarfile.open(tmp, "w") as tar:
        tar.add(results.path, arcname=results.path.name)
        for path in sorted(suites.glob("*.json")):
            if path.resolve() != results.path.resolve() and path.stat().st_mtime >= since:
                tar.add(path, arcname=path.name)
    os.replace(tmp, folder / "results.tar")


def available_suites() -> set[str]:
    sys.path.insert(0, str(HERE))
    import run

    return set(run.TRAIN_SUITES) | set(run.OTHER_SUITES)


def interrupted(signum, frame) -> None:
    raise KeyboardInterrupt  # (a stop from outside ends the running step's processes too, as Ctrl-C does)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-s", type=float, help="seconds this sitting may take, its checks included (default: all)")
    p.add_argument("--list", "--dry-run", action="store_true", help="print the plan and what is measured; run nothing")
    p.add_argument("--quick", action="store_true",
                   help=f"the headline figures only (QUICK): at most two sittings of {QUICK_SITTING_S:.0f} s")
    p.add_argument("--only", metavar="NAME", help="run this step, measured or not")
    p.add_argument("--retry-failed", action="store_true", help="run again steps that failed on this tree")
    p.add_argument("--wheels", type=pathlib.Path, default=ROOT / ".whl", help="folder of wheels to install first")
    p.add_argument("--export", type=pathlib.Path, help="folder to write results.tar and sweep.log into as steps end")
    p.add_argument("--results", type=pathlib.Path, default=RESULTS, help="the sweep's state file")
    p.add_argument("--fetch-wheels", type=pathlib.Path, metavar="DIR",
                   help="where pip reaches an index: download the GPU machine's wheels (WHEELS) into DIR")
    p.add_argument("--gather-parts", action="store_true",
                   help="keep the parts of large wheels the --wheels folder and those beside it carry (a run of its "
                        "own on a warm GPU machine, before the sitting's)")
    p.add_argument("--pack-baseline", action="store_true",
                   help=f"where git is: unpack {BASELINE}'s packages/ into {BASELINE_DIR} and print what to copy along")
    args = p.parse_args(argv)
    if args.pack_baseline:
        pack_baseline()
        return
    if args.fetch_wheels:
        fetch_wheels(args.fetch_wheels)
        return
    if args.gather_parts:
        print("joined:", ", ".join(w.name for w in gather_parts(args.wheels)) or "none yet")
        return
    start, since = time.monotonic(), time.time()
    steps = build_steps(QUICK if args.quick else STEPS)
    only = None
    if args.only:
        only = next((s for s in steps if s.name == args.only), None)
        if only is None:
            p.error(f"--only: no step {args.only!r} (steps: {', '.join(s.name for s in steps)})")
    results = Results(args.results)
    ctx = Context(tree_hash(), git_state(), {}, available_suites(), baseline_problem(), not HOST_USED.exists(),
                  step_versions(steps), os.environ.get("SLIDE_MACHINE"))
    head = f"tree {ctx.tree[:12]} (packages/ and benchmarks/ as they are here; commit {ctx.git['commit'] or '?'}" \
           + {True: ", dirty)", False: ", clean)", None: ")"}[ctx.git["dirty"]] \
           + f"; planned with {ctx.machine or 'this host' + chr(39) + 's probe'}; a step is measured for the version " \
             "of what it runs"
    if args.list:
        sweep = Sweep(steps, results, ctx, runner=lambda *_: Outcome(0), retry_failed=args.retry_failed)
        print(head)
        print("  #  step                 estimate   state   (* the table's estimate: never measured)")
        print("\n".join(sweep.describe(steps)))
        pending = sweep.pending()
        if args.budget_s is not None:
            chosen = sweep.choose(pending, args.budget_s)
            runs = [s for s in chosen if not why_not_run(s, ctx)]
            print(f"--budget-s {args.budget_s:.0f} would run: {', '.join(s.name for s in runs) or 'nothing'} "
                  f"({sum(sweep.estimate(s) for s in runs):.0f} s by estimate)")
            skips = [s.name for s in chosen if s not in runs]
            if skips:
                print(f"and record as skipped: {', '.join(skips)}")
        print(f"left: {len(pending)} steps, {sum(sweep.estimate(s) for s in pending):.0f} s by estimate")
        if args.quick:
            budget = args.budget_s or QUICK_SITTING_S
            plan, over = sweep.sittings(pending, budget)
            for i, sitting in enumerate(plan, 1):
                print(f"sitting {i} of {budget:.0f} s: {', '.join(s.name for s in sitting)} "
                      f"({sum(sweep.estimate(s) for s in sitting) + SETUP_S:.0f} s by estimate, setup included)")
            if over:
                print(f"no sitting of {budget:.0f} s holds: {', '.join(s.name for s in over)}")
        return

    signal.signal(signal.SIGTERM, interrupted)
    print(head, flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    installed = install_wheels(args.wheels) if args.wheels.is_dir() else []
    if installed:
        env["PYTHONPATH"] = os.pathsep.join([str(WHEEL_SITE), *filter(None, [env.get("PYTHONPATH")])])
    if ctx.git["commit"]:
        env.setdefault("SLIDE_COMMIT", ctx.git["commit"])  # (run.py stamps results with it)
    ctx.env = {**check_environment(env), "wheels": installed}
    e = ctx.env
    print(f"python {e['python']}; " + ", ".join(f"{k} {v}" for k, v in e["versions"].items()), flush=True)
    print(f"GPU: {e['gpu']} ({e['gpu_gib']} GiB, {e['gpus']} visible); host {e['host_memory_gib']} GiB, "
          f"{e['cores']} cores; free disk " + ", ".join(f"{k} {v} GiB" for k, v in e["disk_free_gib"].items()),
          flush=True)
    if e["gpu"] is None:
        sys.exit("no CUDA GPU is visible: every step needs one (--list works anywhere)")
    results.doc["environment"] = {**ctx.env, "machine_file": ctx.machine}
    results.save()
    srcs = [str(ROOT / "packages" / p / "src") for p in PACKAGES]
    # GPU tests import this checkout's sources, as noxfile.py's gpu session has them; run.py puts them on its path
    env["PYTHONPATH"] = os.pathsep.join([*srcs, *filter(None, [env.get("PYTHONPATH")])])
    log = args.export / "sweep.log" if args.export else None
    if args.export:
        export(args.export, results, since)

    def after_step() -> None:
        if args.export:
            export(args.export, results, since)

    sweep = Sweep(steps, results, ctx, ProcessRunner(env, log), after_step=after_step,
                  mark_host_used=lambda: HOST_USED.touch(), retry_failed=args.retry_failed)
    sweep.run(args.budget_s, start, only)
    elapsed = time.monotonic() - start
    print(f"\nthis sitting: {elapsed:.0f} s" + ("" if args.budget_s is None else f" of {args.budget_s:.0f}"))
    left = sweep.pending()
    if left:
        print(f"left for a later sitting ({sum(sweep.estimate(s) for s in left):.0f} s by estimate):")
        print("\n".join(sweep.describe(left)))
    else:
        print("nothing left: every step is measured on this tree")
    failed = [n for n in sweep.ran if results.get(n)["status"] == "failed"]
    if failed:
        sys.exit(f"failed in this sitting: {', '.join(failed)}")


if __name__ == "__main__":
    main()
