"""Sessions: `tests` per package (fresh venv, only what the package declares), `lint`, `benchmarks` and `gpu`.

`nox` with no arguments runs lint, every package's tests and the benchmark sweep's tests on the CPU, as CI does.
The `gpu` session is for a machine with a CUDA GPU; it runs the tests marked `gpu`.
"""

from __future__ import annotations

import pathlib
import re

import nox
import tomllib

ROOT = pathlib.Path(__file__).parent
PACKAGES = ["slide-kernels", "slide-memory", "slide-io", "slide-scheduler", "slide-train"]
# The CPU build of torch lies on CI's disk; a plain `torch` would pull a multi-GB CUDA build.
TORCH = "torch==2.13.0"
# The CPU sessions spread their tests over every core (pytest-xdist): most of the long ones are the planner's
# searches, pure Python on one core each.
SPREAD = ["-n", "auto"]

nox.options.sessions = ["lint", "tests", "benchmarks"]
nox.options.reuse_existing_virtualenvs = True


def siblings(package: str) -> list[str]:
    """The monorepo packages `package` depends on, directly or not, in install order."""
    meta = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())["project"]
    found: list[str] = []
    for dep in meta.get("dependencies", []):
        name = re.split(r"[<>=!~; \[]", dep, maxsplit=1)[0]
        if name in PACKAGES:
            for sub in [*siblings(name), name]:
                if sub not in found:
                    found.append(sub)
    return found


@nox.session(python=False)
def lint(session: nox.Session) -> None:
    session.run("python", "-m", "pip", "install", "-q", "ruff>=0.6")
    session.run("python", "-m", "ruff", "check", ".")


@nox.session
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    # Siblings come from this checkout, so a missing dependency declaration fails here, not for a user.
    local = [arg for sib in siblings(package) for arg in ("-e", f"packages/{sib}")]
    session.install(TORCH)
    session.install(*local, "-e", f"packages/{package}[test]")
    session.run("pytest", f"packages/{package}/tests", "-m", "not gpu", *SPREAD, *session.posargs)


@nox.session
def benchmarks(session: nox.Session) -> None:
    """benchmarks/sweep.py's planning and bookkeeping, run.py's plans of the long runs (slide-train's planner), and
    the committed GPU figures against their plans made again."""
    session.install(TORCH)
    # (slide-train's test extra brings pytest and xdist)
    session.install(*[arg for sib in siblings("slide-train") for arg in ("-e", f"packages/{sib}")],
                    "-e", "packages/slide-train[test]")
    session.run("pytest", "benchmarks/test_sweep.py", "benchmarks/test_plans_measured.py", *SPREAD,
                *session.posargs)


@nox.session(python=False)
def gpu(session: nox.Session) -> None:
    """On a GPU machine (it may have no network): its python3 with packages/*/src on PYTHONPATH, tests marked gpu."""
    paths = ":".join(str(ROOT / "packages" / p / "src") for p in PACKAGES)
    for package in PACKAGES:  # one pytest per package: each tests/ folder has its own conftest
        session.run("python3", "-m", "pytest", "-m", "gpu", f"packages/{package}/tests", *session.posargs,
                    env={"PYTHONPATH": paths}, success_codes=[0, 5])
