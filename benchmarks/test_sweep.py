"""sweep.py's planning and bookkeeping on a CPU: steps run by fake runners on a fake clock, over a small tree."""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile

import pytest
import sweep

H100 = {"gpu": "NVIDIA H100 80GB HBM3", "gpu_gib": 79.2, "versions": {"liger-kernel": "0.8.5", "pytest": "8.4"}}
H200 = {**H100, "gpu": "NVIDIA H200", "gpu_gib": 139.8}
TABLE = [
    {"name": "tests", "estimate_s": 100, "run": ["pytest slide-kernels"]},
    {"name": "big", "estimate_s": 400, "run": ["run.py b3 --systems slide"]},
    {"name": "small", "estimate_s": 50, "run": ["run.py b1 --systems slide,liger"]},
    {"name": "probe", "estimate_s": 30, "run": ["run.py probe"], "fresh_host": True},
]


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Runner:
    """Takes `took[name]` seconds of the fake clock per command (10 by default), or is stopped at the deadline."""

    def __init__(self, clock: Clock, took: dict | None = None, fail: tuple = (), during=None):
        self.clock, self.took, self.fail, self.during = clock, took or {}, fail, during
        self.ran: list[str] = []

    def __call__(self, step, command, deadline):
        self.ran.append(step.name)
        if self.during:
            self.during(step)
        took = self.took.get(step.name, 10.0)
        if deadline is not None and took > deadline:
            self.clock.t += deadline
            return sweep.Outcome(-2, stopped=True)
        self.clock.t += took
        return sweep.Outcome(1 if step.name in self.fail else 0, tail=[f"{command.text}: done"])


def make_tree(root):
    """Two packages, slide-train needing slide-kernels, and the harness files."""
    for name, needs in (("slide-kernels", []), ("slide-train", ["slide-kernels>=0.1,<0.2", "torch"])):
        src = root / "packages" / name / "src" / name.replace("-", "_")
        src.mkdir(parents=True)
        (src / "__init__.py").write_text("VALUE = 1\n")
        (root / "packages" / name / "tests").mkdir()
        (root / "packages" / name / "tests" / "test_it.py").write_text("def test(): pass\n")
        (root / "packages" / name / "pyproject.toml").write_text(
            f'[project]\nname = "{name}"\ndependencies = {needs!r}\n'.replace("'", '"'))
    (root / "benchmarks" / "results").mkdir(parents=True)
    for name in ("run.py", "worker.py", "common.py", "tables.py", "kernel_bench.py", "sweep.py", "README.md"):
        (root / "benchmarks" / name).write_text(f"# {name}\n")
    (root / ".gitignore").write_text("__pycache__/\n*.egg-info/\nbuild/\nbenchmarks/results/*.partial.json\n")


@pytest.fixture
def tree(tmp_path):
    make_tree(tmp_path / "repo")
    return tmp_path / "repo"


def make(tree, table=TABLE, env=H100, fresh=False, suites=("b1", "b3", "b8", "moe", "probe"), baseline=None,
         clock=None, runner=None, **kw):
    clock = clock or Clock()
    runner = runner or Runner(clock)
    ctx = sweep.Context(sweep.tree_hash(tree), {"commit": "abc", "dirty": False}, dict(env), set(suites), baseline,
                        fresh, sweep.step_versions(sweep.build_steps(table), tree))
    results = sweep.Results(tree / "benchmarks" / "results" / "sweep.json")
    return sweep.Sweep(sweep.build_steps(table), results, ctx, runner, clock=clock, say=lambda _: None, **kw)


def saved(tree) -> dict:
    return json.loads((tree / "benchmarks" / "results" / "sweep.json").read_text())["steps"]


def test_steps_run_most_important_first_and_a_fresh_host_step_only_first(tree):
    s = make(tree)
    s.run(None, 0.0)
    assert s.runner.ran == ["tests", "big", "small"]
    assert "fresh host" in "\n".join(s.describe(s.pending()))  # (the host was not fresh: probe waits)

    marked = []
    s = make(tree, fresh=True, mark_host_used=lambda: marked.append(1))
    s.run(None, 0.0)
    assert s.runner.ran == ["probe"]  # (the others were measured above on the same tree)
    assert marked == [1] and not s.ctx.host_fresh


def test_fresh_host_step_runs_before_more_important_ones(tree):
    s = make(tree, fresh=True)
    s.run(None, 0.0)
    assert s.runner.ran == ["probe", "tests", "big", "small"]


def test_a_step_that_does_not_fit_is_passed_over_for_smaller_later_ones(tree):
    s = make(tree)
    s.run(200, 0.0)
    assert s.runner.ran == ["tests", "small"]
    assert set(saved(tree)) == {"tests", "small"}
    assert [st.name for st in s.pending()] == ["big", "probe"]
    assert s.estimate(s.steps[1]) == 400  # (what is left is listed with its estimate)


def test_the_budget_counts_time_spent_before_the_steps(tree):
    clock = Clock()
    clock.t = 150.0  # the wheels and the environment check took 150 s of a 200 s budget
    s = make(tree, clock=clock)
    s.run(200, 0.0)
    assert s.runner.ran == ["small"]


def test_a_step_that_runs_long_leaves_less_and_one_that_runs_short_more(tree):
    clock = Clock()
    s = make(tree, clock=clock, runner=Runner(clock, took={"tests": 180}))
    s.run(200, 0.0)
    assert s.runner.ran == ["tests"]  # small's 50 s no longer fit

    shutil.rmtree(tree / "benchmarks" / "results")
    clock = Clock()
    s = make(tree, clock=clock, runner=Runner(clock, took={"tests": 5, "small": 5, "big": 300}))
    s.run(460, 0.0)  # by the estimates big does not fit after tests; tests ran short, so it does
    assert s.runner.ran == ["tests", "small", "big"]


def test_each_result_is_written_as_its_step_ends(tree):
    seen = []

    def during(step):
        seen.append(set(saved(tree)) if (tree / "benchmarks" / "results" / "sweep.json").is_file() else set())
        if step.name == "small":
            raise KeyboardInterrupt  # the sitting is stopped from outside in the third step

    clock = Clock()
    s = make(tree, clock=clock, runner=Runner(clock, during=during))
    with pytest.raises(KeyboardInterrupt):
        s.run(None, 0.0)
    assert seen == [set(), {"tests"}, {"tests", "big"}]
    assert set(saved(tree)) == {"tests", "big"}
    assert saved(tree)["big"]["status"] == "ok" and saved(tree)["big"]["wall_s"] == 10.0


def test_a_measured_step_is_not_run_again_until_the_code_changes(tree):
    make(tree).run(None, 0.0)
    s = make(tree)
    s.run(None, 0.0)
    assert s.runner.ran == []

    # results, caches and ignored files are not the code
    (tree / "benchmarks" / "results" / "b3.json").write_text("{}")
    (tree / "benchmarks" / "__pycache__").mkdir()
    (tree / "benchmarks" / "__pycache__" / "run.cpython-312.pyc").write_bytes(b"\0")
    (tree / "packages" / "slide-kernels" / "slide_kernels.egg-info").mkdir()
    (tree / "build").mkdir()
    s = make(tree)
    s.run(None, 0.0)
    assert s.runner.ran == []

    (tree / "packages" / "slide-kernels" / "src" / "slide_kernels" / "__init__.py").write_text("VALUE = 2\n")
    s = make(tree)
    s.run(None, 0.0)
    assert s.runner.ran == ["tests", "big", "small"]
    results = saved(tree)
    assert all(results[st.name]["tree"] == s.ctx.tree and results[st.name]["code"] == s.ctx.version(st)
               for st in s.steps if st.name in results)


def test_a_failing_step_is_recorded_and_the_sweep_goes_on(tree):
    clock = Clock()
    s = make(tree, clock=clock, runner=Runner(clock, fail=("tests",)))
    s.run(None, 0.0)
    assert s.runner.ran == ["tests", "big", "small"]
    result = saved(tree)["tests"]
    assert result["status"] == "failed" and result["commands"][0]["returncode"] == 1
    assert result["tail"] == ["pytest slide-kernels: done"]
    assert saved(tree)["big"]["status"] == "ok"

    s = make(tree)
    s.run(None, 0.0)
    assert s.runner.ran == []  # a failure on this tree is its result
    s = make(tree, retry_failed=True)
    s.run(None, 0.0)
    assert s.runner.ran == ["tests"]


def test_a_step_stopped_at_the_budgets_end_stays_queued_with_a_larger_estimate(tree):
    clock = Clock()
    table = [{"name": "slow", "estimate_s": 100, "run": ["run.py b8"]}]
    s = make(tree, table, clock=clock, runner=Runner(clock, took={"slow": 400}))
    s.run(300, 0.0)
    result = saved(tree)["slow"]
    assert result["stopped"] and result["status"] == "failed" and result["wall_s"] == 300
    assert [st.name for st in s.pending()] == ["slow"]
    assert s.estimate(s.steps[0]) == 375


def test_the_estimate_is_the_last_wall_time(tree):
    clock = Clock()
    s = make(tree, clock=clock, runner=Runner(clock, took={"small": 130}))
    assert s.estimate(s.steps[2]) == 50
    s.run(None, 0.0)
    assert s.estimate(s.steps[2]) == 130
    assert make(tree).estimate(make(tree).steps[2]) == 130  # (read back from the file)


def test_a_suite_run_py_lacks_is_skipped_with_the_reason_and_stays_queued(tree):
    table = [{"name": "long", "estimate_s": 300, "run": ["run.py long"]}, *TABLE[:1]]
    s = make(tree, table)
    s.run(120, 0.0)  # a skip takes no time: tests still fits
    assert s.runner.ran == ["tests"]
    assert saved(tree)["long"]["status"] == "skipped"
    assert saved(tree)["long"]["reason"].startswith("suite not available")
    assert [st.name for st in s.pending()] == ["long"]


def test_steps_against_the_baseline_or_a_peer_need_them_there(tree):
    table = [{"name": "b3-none", "estimate_s": 60, "run": [f"run.py b3 --systems baseline --modes none "
                                                            f"{sweep.VS_BASELINE}"]}, *TABLE]
    s = make(tree, table, env={**H100, "versions": {"liger-kernel": None, "pytest": "8.4"}},
             baseline="no baseline engine in build/baseline")
    s.run(None, 0.0)
    assert s.runner.ran == ["tests", "big"]
    assert saved(tree)["b3-none"]["reason"] == "no baseline engine in build/baseline"
    assert saved(tree)["small"]["reason"].startswith("liger-kernel is not installed")
    assert sweep.why_not_run(sweep.build_steps([{"name": "p", "estimate_s": 1, "run": ["run.py probe"]}])[0],
                             s.ctx) is None  # (a suite without peers needs no Liger)


def test_a_command_that_needs_a_larger_gpu_is_recorded_as_not_fitting(tree):
    table = [{"name": "moe", "estimate_s": 100,
              "run": ["run.py moe --systems slide", {"cmd": "run.py moe --systems plain", "gpu_gib": 120,
                                                     "why": "fp32 states"}]}]
    seen = []
    clock = Clock()
    s = make(tree, table, clock=clock, runner=Runner(clock, during=lambda step: seen.append(step.name)))
    s.run(None, 0.0)
    assert len(seen) == 1  # the peer did not run on the H100
    result = saved(tree)["moe"]
    assert result["status"] == "partial" and result["gpu_gib"] == 79.2
    assert result["commands"][1]["status"] == "does not fit"
    assert "120 GiB" in result["commands"][1]["reason"] and "fp32 states" in result["commands"][1]["reason"]
    assert make(tree, table).pending() == []  # another H100 has nothing to add
    s = make(tree, table, env=H200)
    s.run(None, 0.0)
    assert s.runner.ran == ["moe", "moe"]
    assert saved(tree)["moe"]["status"] == "ok"


def test_the_tree_hash_is_gits_tree_id_of_the_files(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = tmp_path / "repo"
    make_tree(root)
    # git's order of names (a folder sorts as if it ended in "/"), an executable file, a nested .gitignore
    pkg = root / "packages" / "slide-kernels"
    (pkg / "a.b").write_text("x")
    (pkg / "a").mkdir()
    (pkg / "a" / "c").write_text("y")
    (pkg / "a-b").write_text("z")
    (pkg / "tool.sh").write_text("#!/bin/sh\n")
    (pkg / "tool.sh").chmod(0o755)
    (pkg / "tests" / ".gitignore").write_text("scratch*\n")
    (pkg / "tests" / "test_x.py").write_text("def test(): pass\n")

    def git(*args):
        return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "t")
    # files git does not keep, made after the commit
    (pkg / "tests" / "scratch.txt").write_text("ignored")
    (pkg / "src" / "slide_kernels" / "__pycache__").mkdir()
    (pkg / "src" / "slide_kernels" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    (pkg / "empty").mkdir()
    assert sweep.folder_id(root, "packages") == git("rev-parse", "HEAD:packages")
    assert sweep.folder_id(root, "packages/slide-kernels/tests") == git("rev-parse",
                                                                        "HEAD:packages/slide-kernels/tests")
    assert sweep.Code(root).id("packages/slide-kernels/tests") == git("rev-parse", "HEAD:packages/slide-kernels/tests")
    assert sweep.Code(root).id("benchmarks/run.py") == git("rev-parse", "HEAD:benchmarks/run.py")
    before = sweep.tree_hash(root)
    (pkg / "a" / "c").write_text("changed")
    assert sweep.tree_hash(root) != before


def test_runs_plan_with_the_gpu_rates_their_machine_file_lacks(tmp_path, capsys):
    """gpu-rates.json fills in the rates the machine file has not measured (0), where it was measured on this GPU;
    a rate the file has stays, and another GPU's figures, or none, leave the file as it is."""
    import run

    from slide_scheduler import Gpu, Machine
    from slide_train.machines import load_machine, save_machine

    source, results = tmp_path / "host.yaml", tmp_path / "results"
    save_machine(Machine(gpu=Gpu(memory_gib=140.0, bf16_tflops=797.0, experts_tflops=150.0)), source)
    assert run.planning_machine(tmp_path, results, "NVIDIA H200", str(source)) is None  # (nothing measured yet)
    results.mkdir()
    figure = {"system": "gpu", "status": "ok", "memory_gib": 139.8, "bf16_tflops": 700.0, "attention_tflops": 420.5,
              "experts_tflops": 120.0}
    (results / "gpu-rates.json").write_text(json.dumps({"suite": "gpu-rates", "device": "NVIDIA H200",
                                                        "date": "d", "figures": [figure]}))
    path = run.planning_machine(tmp_path, results, "NVIDIA H200", str(source))
    planned = load_machine(path)
    assert planned.gpu == Gpu(memory_gib=140.0, bf16_tflops=797.0, attention_tflops=420.5, experts_tflops=150.0)
    assert planned.host == load_machine(source).host and planned.disk == load_machine(source).disk
    assert "this GPU's attention_tflops 420.5" in capsys.readouterr().out
    assert run.planning_machine(tmp_path, results, "NVIDIA H100 80GB HBM3", str(source)) is None
    assert "measured on NVIDIA H200, not this NVIDIA H100 80GB HBM3" in capsys.readouterr().out
    assert run.planning_machine(tmp_path, results, None, str(source)) is None


def test_the_step_table(tree):
    steps = sweep.build_steps(sweep.STEPS)
    assert all(s.estimate_s <= sweep.STEP_LIMIT_S for s in steps)
    import run

    for step in steps:
        for command in step.commands:
            argv = command.argv("python3")
            if command.words[0] == "pytest":
                assert argv[2:5] == ["pytest", "-m", "gpu"]
                continue
            assert set(command.suites()) <= set(run.TRAIN_SUITES) | set(run.OTHER_SUITES)
            assert set(command.systems()) <= set(run.SYSTEMS)

    # old, new, new, old over each bench's steps against the baseline, run.py putting slide before the baseline
    # within a mode and the peers after both
    for bench in ("b3", "b8"):
        order = []
        for step in steps:
            for command in step.commands:
                words = command.words
                if command.suites() == [bench] and command.uses_baseline():
                    modes = words[words.index("--modes") + 1].split(",")
                    systems = command.systems()
                    order += [s for m in modes for s in ("slide", "baseline") if s in systems]
        assert order == ["baseline", "slide", "slide", "baseline"], bench


def test_export_holds_the_state_and_the_files_this_run_wrote(tree, tmp_path):
    s = make(tree)
    s.run(None, 0.0)
    results = tree / "benchmarks" / "results"
    (results / "old.json").write_text("{}")
    import os

    os.utime(results / "old.json", (1, 1))
    (results / "b3.json").write_text("{}")
    sweep.export(tmp_path / "out", s.results, since=1000.0, suites=results)
    with tarfile.open(tmp_path / "out" / "results.tar") as tar:
        assert sorted(tar.getnames()) == ["b3.json", "sweep.json"]


def test_a_process_past_its_deadline_is_interrupted_then_killed(tmp_path, monkeypatch):
    """The real runner: output streams into the tail and the log; at the deadline the process group gets an
    interrupt, and one that ignores it is killed after the grace period."""
    import sys
    import time

    monkeypatch.setattr(sweep, "GRACE_S", 0.5)
    script = ("import signal, sys, time\n"
              "if sys.argv[1] == 'stubborn':\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
              "print('started', flush=True)\ntime.sleep(30)\n")
    runner = sweep.ProcessRunner(env={}, log=tmp_path / "sweep.log")
    step = sweep.build_steps([{"name": "s", "estimate_s": 1, "run": ["run.py probe"]}])[0]
    for kind in ("plain", "stubborn"):
        monkeypatch.setattr(sweep.Command, "argv", lambda self, python, k=kind: [sys.executable, "-c", script, k])
        t0 = time.monotonic()
        out = runner(step, step.commands[0], 0.5)
        assert out.stopped and out.returncode != 0 and out.tail[0] == "started", kind
        assert time.monotonic() - t0 < 5, kind
    assert (tmp_path / "sweep.log").read_text().count("started\n") == 2
    monkeypatch.setattr(sweep.Command, "argv", lambda self, python: [sys.executable, "-c", "print('done')"])
    out = runner(step, step.commands[0], 5.0)
    assert not out.stopped and out.returncode == 0 and out.tail == ["done"]


def test_a_step_that_runs_alone_has_a_sitting_to_itself(tree):
    """An `alone` step runs only as the first step of a sitting, and nothing runs after it; a skipped step before it
    takes no time and does not count."""
    table = [{"name": "tests", "estimate_s": 100, "run": ["pytest slide-kernels"]},
             {"name": "longest", "estimate_s": 300, "alone": True, "run": ["run.py b8"]},
             {"name": "small", "estimate_s": 50, "run": ["run.py b1 --systems slide"]}]
    s = make(tree, table)
    assert [st.name for st in s.choose(s.pending(), 540)] == ["tests", "small"]
    s.run(540, 0.0)
    assert s.runner.ran == ["tests", "small"]
    assert "runs alone in a sitting" in "\n".join(s.describe(s.pending()))
    s = make(tree, table)
    assert [st.name for st in s.choose(s.pending(), 540)] == ["longest"]
    s.run(540, 0.0)
    assert s.runner.ran == ["longest"]
    assert s.pending() == []

    shutil.rmtree(tree / "benchmarks" / "results")
    table = [{"name": "gone", "estimate_s": 10, "run": ["run.py nosuch"]}, table[1], table[2]]
    s = make(tree, table)
    s.run(None, 0.0)  # (the step recorded as skipped ran nothing: the alone one still has the sitting to itself)
    assert s.runner.ran == ["longest"] and saved(tree)["gone"]["status"] == "skipped"
    table.append({"name": "probe", "estimate_s": 30, "run": ["run.py probe"], "fresh_host": True})
    s = make(tree, table, fresh=True)
    s.run(None, 0.0)  # (a fresh host's probe goes first: then the alone step waits for another sitting)
    assert s.runner.ran == ["probe", "small"]


LONG_STEPS = {"long-8b-clip": ("8b-32k,8b-128k", "1.0"), "long-8b-none": ("8b-32k,8b-128k", "none"),
              "long-8b-longest-clip": ("8b-longest", "1.0"), "long-8b-longest-none": ("8b-longest", "none"),
              "long-3b-longest": ("3b-longest", "1.0"), "long-peer": ("peer", None)}


def test_the_long_suite_runs_in_steps_of_one_sitting_each(capsys):
    """run.py long's parts: each run and clip mode of run.LONG (and the peer's ladder) in a step of its own, each
    estimated within a sitting (8B at 131,072 tokens: setup, then 3 steps of up to 90 s), the longest runs alone; the
    dry run lists them."""
    import run

    steps = {s.name: s for s in sweep.build_steps(sweep.STEPS)}
    assert "long" not in steps and {n for n in steps if n.startswith("long")} == set(LONG_STEPS)
    wanted = {(name, mode) for name, r in run.LONG["runs"].items() for mode in r.get("modes", run.LONG["modes"])}
    covered = set()
    for name, (variant, mode) in LONG_STEPS.items():
        step = steps[name]
        (command,) = step.commands
        words = command.words
        assert command.suites() == ["long"] and words[words.index("--variants") + 1] == variant
        assert step.estimate_s <= sweep.STEP_LIMIT_S and step.alone == variant.endswith("-longest")
        if variant == "peer":
            assert command.systems() == ["liger"]  # (skipped where Liger-Kernel is not there)
            continue
        assert words[words.index("--modes") + 1] == mode
        covered |= {(v, mode) for v in variant.split(",")}
        if "8b-128k" in variant:  # (one process: its setup, 3 steps of 32k rows at 28 s and of 131,072 at 56 s)
            assert step.estimate_s >= 120 + 3 * 28 + 3 * 56
    assert covered == wanted
    assert run.LONG["sitting_s"] <= sweep.STEP_LIMIT_S  # (run.py plans a longest run within a step)

    sweep.main(["--dry-run"])
    out = capsys.readouterr().out
    for name in LONG_STEPS:
        assert f" {name} " in out, name
    assert out.count("runs alone in a sitting") == 3


class LongArgs:
    """run.py's parsed arguments, as the long suite reads them."""

    def __init__(self, **kw):
        self.variants, self.systems, self.modes = [], ["slide", "liger"], ["1.0", "none"]
        self.timeout, self.quiet = None, True
        self.__dict__.update(kw)


def fake_long(monkeypatch, tmp_path, oom_at=65536):
    """run.py's long suite with its workers, data and planner faked: the specs it would run, in order."""
    import run

    specs, processes = [], []

    def one(spec):
        if spec["job"] == "liger" and spec["seq_len"] >= oom_at:
            return {"status": "does not fit", "reason": "out of GPU memory: CUDA out of memory", "device": "GPU"}
        return {"status": "ok", "device": "GPU", "tokens_per_s": spec["seq_len"] / 10, "tflops": 1.0,
                "tflops_attn": 2.0, "step_s": 10.0, "gpu_peak_gib": 20.0, "host_rss_gib": 100.0,
                "predicted_step_s": 8.0, "wall_s": 100.0, "step_s_each": [10.0, 10.0, 10.0]}

    def worker(spec, work, name, timeout, pythonpath=None, quiet=False, machine=None):
        processes.append([s["seq_len"] for s in spec.get("runs", [spec])])
        if spec["job"] == "series":
            specs.extend(spec["runs"])
            return {"status": "ok", "device": "GPU", "runs": [one(s) for s in spec["runs"]]}
        specs.append(spec)
        return one(spec)

    def length(name, mode, machine, calibration):
        return {"model": run.LONG["runs"][name]["model"] + "-256k", "seq_len": 196608, "longest_fits": 229376,
                "step_budget_s": 60.0, "calibration": calibration, "planned_step_s": 55.0}

    monkeypatch.setattr(run, "run_worker", worker)
    monkeypatch.setattr(run, "long_rows", lambda work, model, seq_len, accum, steps=None:
                        work / f"{model}-{seq_len}.jsonl")
    monkeypatch.setattr(run, "long_length", length)
    monkeypatch.setattr(run, "peer_does_not_fit", lambda model, mode: {
        "system": "liger", "variant": f"peer-{model}", "mode": mode, "status": "does not fit", "reason": "16 bytes"})
    import sys
    import types

    fake = types.ModuleType("slide_train")  # (the planner's imports: no torch in this test)
    errors, machines = types.ModuleType("slide_train.errors"), types.ModuleType("slide_train.machines")
    errors.ConfigError = type("ConfigError", (ValueError,), {})
    machines.resolve_machine = lambda path, work: "machine"
    for name, module in (("slide_train", fake), ("slide_train.errors", errors), ("slide_train.machines", machines)):
        monkeypatch.setitem(sys.modules, name, module)
    return run, specs, processes


def test_the_long_suite_builds_each_run_as_the_issue_asks(tmp_path, monkeypatch):
    """Slide: Llama-3.1-8B at 4 x 32,768 and 1 x 131,072 under 24 GiB, clip 1.0 and off, one warm-up and two timed
    steps; the longest rows from the plan, on the -256k preset past 131,072; Llama-3.2-3B at its longest with clip
    1.0. The peer: Llama-3.2-3B at increasing lengths, uncapped, until it runs out of memory, its longest recorded
    with its tokens/s there, and 8B recorded as not fitting."""
    run, specs, processes = fake_long(monkeypatch, tmp_path)
    doc = run.run_long_suite(LongArgs(), tmp_path, tmp_path / "out")
    slide = [(s["model"], s["seq_len"], s["grad_accum"], s["mode"]) for s in specs if s["job"] == "slide"]
    assert slide == [("llama-3.1-8b", 32768, 4, "1.0"), ("llama-3.1-8b", 131072, 1, "1.0"),
                     ("llama-3.1-8b-256k", 196608, 1, "1.0"), ("llama-3.2-3b-256k", 196608, 1, "1.0"),
                     ("llama-3.1-8b", 32768, 4, "none"), ("llama-3.1-8b", 131072, 1, "none"),
                     ("llama-3.1-8b-256k", 196608, 1, "none")]
    # the 32k and 128k rows of a mode share one process (8B's setup once); a longest run has one of its own
    assert processes[:3] == [[32768, 131072], [196608], [196608]] and processes[3:5] == [[32768, 131072], [196608]]
    for s in specs:
        assert (s["warmup"], s["steps"], s["micro_batch_size"], s["device"]) == (1, 2, 1, "cuda")
        assert s["cap_gib"] == (24.0 if s["job"] == "slide" else None)
    peer = [s["seq_len"] for s in specs if s["job"] == "liger"]
    assert peer == [16384, 32768, 65536] and {s["model"] for s in specs if s["job"] == "liger"} == {"llama-3.2-3b"}
    by = {(e["variant"], e["mode"]): e for e in doc["figures"]}
    longest = by[("peer-longest", "1.0")]
    assert longest["longest"] == 32768 and longest["tokens_per_s"] == 3276.8 and "65,536" in longest["stopped"]
    assert by[("peer-llama-3.1-8b", "1.0")]["status"] == "does not fit"
    assert by[("8b-longest", "none")]["longest_fits"] == 229376
    assert by[("8b-128k", "1.0")]["tokens_per_step"] == by[("8b-32k", "1.0")]["tokens_per_step"] == 131072
    assert all("tflops_attn" in e for e in doc["figures"] if e.get("status") == "ok")
    assert (tmp_path / "out" / "long.partial.json").is_file()


def test_the_long_suite_runs_in_parts_merged_into_one_file(tmp_path, monkeypatch):
    """Each sweep step runs a part (`--variants`, `--modes`): main merges it into long.json beside the others',
    and the training table of tables.py reads the file."""
    import sys

    run, specs, _ = fake_long(monkeypatch, tmp_path)
    out = tmp_path / "out"
    for argv in (["long", "--variants", "8b-128k", "--modes", "1.0"],
                 ["long", "--variants", "8b-32k", "--modes", "1.0"],
                 ["long", "--variants", "peer", "--systems", "liger"]):
        monkeypatch.setattr(sys, "argv", ["run.py", *argv, "--out", str(out), "--work", str(tmp_path), "--quiet"])
        run.main()
    doc = json.loads((out / "long.json").read_text())
    assert [(e["variant"], e["mode"]) for e in doc["figures"]] == [
        ("8b-128k", "1.0"), ("8b-32k", "1.0"), *[(f"peer-{n}", "1.0") for n in (16384, 32768, 65536)],
        ("peer-longest", "1.0"), ("peer-llama-3.1-8b", "1.0")]
    assert not (out / "long.partial.json").exists()
    with pytest.raises(ValueError, match="no long run"):
        run.run_long_suite(LongArgs(variants=["8b-1m"]), tmp_path, out)


def test_a_longest_run_is_planned_within_one_sitting(tmp_path):
    """On the H200 host's machine file under 24 GiB, by slide-train's planner: the longest rows fit the plan, run on
    the -256k preset only past 131,072, and their predicted time, each step `margin` times the prediction after the
    setup, fits the sitting; a margin the 131,072-token run measured takes the place of LONG's."""
    import sys

    # (in a process of its own, with benchmarks/ last on the path, as a sweep step runs run.py)
    code = f"""
import json, pathlib, sys
sys.path.append({str(sweep.HERE)!r})
import run
from slide_train.machines import load_machine
machine = load_machine({str(sweep.ROOT / "docs" / "machines" / "h200-host.yaml")!r})
out = pathlib.Path({str(tmp_path)!r})
default = run.long_calibration(out, "1.0")
(out / "long.json").write_text(json.dumps({{"figures": [{{"system": "slide", "variant": "8b-128k", "mode": "1.0",
    "status": "ok", "step_s": 90.0, "predicted_step_s": 45.0, "wall_s": 330.0, "step_s_each": [90.0, 90.0, 90.0],
    "date": "d"}}]}}))
measured = run.long_calibration(out, "1.0")
found = run.long_length("8b-longest", "1.0", machine, measured)
print(json.dumps({{"default": default, "measured": measured, "found": found}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["default"]["margin"] == 2.0 and got["measured"] == {"margin": 2.2, "setup_s": 66.0,
                                                                   "from": "the 8b-128k run, clip 1.0, of d"}
    found = got["found"]
    assert 0 < found["seq_len"] <= found["longest_fits"] and found["seq_len"] % 1024 == 0
    assert found["model"] == ("llama-3.1-8b-256k" if found["seq_len"] > 131072 else "llama-3.1-8b")
    assert found["planned_step_s"] <= found["step_budget_s"] == round((480 - 66.0) / 3 / 2.2, 1)


def test_a_steps_version_is_what_it_runs(tree):
    """A GPU test's version follows its package and the packages it needs; a run.py step's, the harness files, its
    suite's own and the packages slide-train needs; files no step runs change none."""
    table = [{"name": "kernels-tests", "estimate_s": 10, "run": ["pytest slide-kernels"]},
             {"name": "train-tests", "estimate_s": 10, "run": ["pytest slide-train"]},
             {"name": "b3", "estimate_s": 10, "run": ["run.py b3"]},
             {"name": "kernels", "estimate_s": 10, "run": ["run.py kernels"]}]
    steps = sweep.build_steps(table)
    assert sweep.package_needs(tree, "slide-train") == ["slide-kernels", "slide-train"]
    assert sweep.package_needs(tree, "slide-kernels") == ["slide-kernels"]

    def changed(rel, text="changed\n"):
        before = sweep.step_versions(steps, tree)
        (tree / rel).write_text(text)
        after = sweep.step_versions(steps, tree)
        return {name for name in before if before[name] != after[name]}

    assert changed("benchmarks/sweep.py") == set()
    assert changed("benchmarks/README.md") == set()
    assert changed("benchmarks/results/b3.json") == set()
    assert changed("packages/slide-train/tests/test_it.py") == {"train-tests"}
    assert changed("packages/slide-train/src/slide_train/__init__.py") == {"train-tests", "b3", "kernels"}
    assert changed("packages/slide-kernels/src/slide_kernels/__init__.py") == set(sweep.step_versions(steps, tree))
    assert changed("packages/slide-kernels/tests/test_it.py") == {"kernels-tests"}
    assert changed("benchmarks/worker.py") == {"b3", "kernels"}
    assert changed("benchmarks/kernel_bench.py") == {"kernels"}
    assert changed("packages/slide-kernels/src/slide_kernels/new.py") == set(sweep.step_versions(steps, tree))
    # (this checkout: slide-train needs every package, slide-scheduler slide-memory and slide-io)
    assert sweep.package_needs(sweep.ROOT, "slide-train") == sorted(sweep.PACKAGES)
    assert sweep.package_needs(sweep.ROOT, "slide-scheduler") == ["slide-io", "slide-memory", "slide-scheduler"]


def test_a_figure_of_an_earlier_version_stays_listed_with_its_commit(tree):
    make(tree).run(None, 0.0)
    (tree / "benchmarks" / "run.py").write_text("# suites, changed\n")
    s = make(tree)
    assert [st.name for st in s.pending()] == ["big", "small", "probe"]  # (the GPU test does not run run.py)
    listed = "\n".join(s.describe(s.steps))
    assert "measured on abc, whose code of this step differs (then: ok on NVIDIA H100 80GB HBM3)" in listed
    assert "measured: ok on NVIDIA H100 80GB HBM3 at abc" in listed


QUICK_HEADLINE = {("b3", "slide", "1.0"), ("b3", "liger", "1.0"), ("b8", "slide", "none"), ("b8", "slide", "1.0"),
                  ("gemma2", "slide", "none"), ("moe", "slide", "none"), ("long", "8b-128k", "1.0")}
# 8B at 131,072 tokens, clip 1.0, on an H100 (issue figures: no long.json is committed yet)
LONG_128K_STEP_S = 55.5


def test_the_quick_list_fits_its_sittings(tree):
    """--quick measures the headline figures in at most two sittings of 540 s, by estimates that cover what the
    committed results measured: each process's setup (its wall time less its steps), its first step, then its
    other steps at their median; a step of over 2 s runs 1 warm-up and 3 timed steps."""
    import run

    steps = sweep.build_steps(sweep.QUICK)
    s = make(tree, sweep.QUICK, suites=set(run.TRAIN_SUITES) | set(run.OTHER_SUITES))
    plan, over = s.sittings(s.pending(), sweep.QUICK_SITTING_S)
    assert len(plan) <= 2 and not over
    assert sum(len(sitting) for sitting in plan) == len(steps)
    assert all(sum(st.estimate_s for st in sitting) + sweep.SETUP_S <= sweep.QUICK_SITTING_S for sitting in plan)

    covered = set()
    for step in steps:
        needed = 0.0
        for command in step.commands:
            words = command.words
            (suite,) = command.suites()
            modes = words[words.index("--modes") + 1].split(",")
            given = {w: int(words[words.index(w) + 1]) for w in ("--warmup", "--steps") if w in words}
            if suite == "long":
                variant = words[words.index("--variants") + 1]
                covered |= {(suite, variant, m) for m in modes}
                warmup, timed = given["--warmup"], given["--steps"]
                needed += run.LONG["setup_s"] + (warmup + timed) * LONG_128K_STEP_S
                continue
            doc = json.loads((sweep.HERE / "results" / f"{suite}.json").read_text())
            # (Slide's step decides: B3's Liger peer at 2.08 s runs beside it on the suites' 2 and 5)
            long_steps = max(f["step_s"] for f in doc["figures"] if f["system"] == "slide" and f["mode"] in modes) > 2
            assert given == ({"--warmup": 1, "--steps": 3} if long_steps else {}), step.name
            for system in command.systems():
                for mode in modes:
                    covered.add((suite, system, mode))
                    (e,) = [f for f in doc["figures"] if (f["system"], f["mode"]) == (system, mode)]
                    each = e["step_s_each"]
                    warmup = given.get("--warmup", doc["config"]["warmup"])
                    timed = given.get("--steps", doc["config"]["steps"])
                    needed += (e["wall_s"] - sum(each)) + each[0] + (warmup - 1 + timed) * e["step_s"]
        assert needed <= step.estimate_s, (step.name, needed)
    assert covered == QUICK_HEADLINE


def test_the_profile_dry_run_and_a_cpu_profile(tmp_path):
    """profile.py --dry-run prints the worker spec of the suite's own shape and writes nothing; on a CPU the tiny
    preset's profiled step comes back with its ops, and each lane's busy time read from the engine's trace, whose
    compute lane is the step's GPU-busy figure."""
    import sys

    import run

    def profile(*argv):
        return subprocess.run([sys.executable, str(sweep.HERE / "profile.py"), *argv], capture_output=True,
                              text=True, cwd=tmp_path, timeout=300)

    done = profile("gemma2", "--mode", "1.0", "--dry-run", "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-3000:]
    spec = json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith("with SPEC: "))[11:])
    shape = run.TRAIN_SUITES["gemma2"]
    assert {k: spec[k] for k in ("model", "seq_len", "micro_batch_size", "grad_accum", "cap_gib")} == \
        {k: shape[k] for k in ("model", "seq_len", "micro_batch_size", "grad_accum", "cap_gib")}
    assert spec["extra"] == list(shape["slide_args"]) and spec["mode"] == "1.0" and spec["job"] == "profile"
    assert (spec["warmup"], spec["steps"]) == (2, 1) and not (tmp_path / "out").exists()
    assert profile("long-8b-128k", "--dry-run").returncode == 0
    assert profile("nosuch", "--dry-run").returncode == 2

    done = profile("tiny", "--top", "5", "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads((tmp_path / "out" / "profile-tiny-clip-none.json").read_text())
    assert got["step"]["step"] == run.TRAIN_SUITES["tiny"]["warmup"] + 1 and got["ops_by"] == "self_cpu_s"
    times = [op["self_cpu_s"] for op in got["ops"]]
    assert len(times) == 5 and times == sorted(times, reverse=True) and sum(times) <= got["ops_total_s"]
    assert got["lanes"]["compute"]["busy_s"] == pytest.approx(got["step"]["gpu_busy_s"], abs=1e-5)
    trace = json.loads((tmp_path / "out" / "profile-tiny-clip-none.lanes.json").read_text())
    assert sum(e.get("ph") == "X" for e in trace["traceEvents"]) == sum(v["spans"] for v in got["lanes"].values())
    assert "Self CPU" in (tmp_path / "out" / "profile-tiny-clip-none.ops.txt").read_text()

    # (a process started from benchmarks/ that imports cProfile, as torch's compiler does, gets the stdlib's)
    code = "import sys; sys.path.insert(0, sys.argv[1]); import cProfile, profile; cProfile.run('1'); " \
           "print(profile.Profile.__module__)"
    done = subprocess.run([sys.executable, "-c", code, str(sweep.HERE)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip().endswith("profile"), done.stderr


def test_a_sitting_installs_only_the_wheels_the_image_lacks(tmp_path, monkeypatch):
    for name in ("datasets-5.2.0-py3-none-any.whl", "liger_kernel-0.8.5-py3-none-any.whl",
                 "pytest-9.2.0-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"")
    monkeypatch.setattr(sweep, "missing_here", lambda names: ["datasets", "dill", "liger-kernel"])
    monkeypatch.setattr(sweep, "WHEEL_STAGE", tmp_path / "stage")
    monkeypatch.setattr(sweep, "WHEEL_SITE", tmp_path / "site")
    ran = []
    monkeypatch.setattr(sweep.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(
        cmd, 0))
    assert sweep.install_wheels(tmp_path) == ["datasets", "liger-kernel"]  # (pytest: the image has it)
    (cmd,) = ran
    assert cmd[-2:] == [str(tmp_path / "datasets-5.2.0-py3-none-any.whl"),
                        str(tmp_path / "liger_kernel-0.8.5-py3-none-any.whl")]
    assert "--no-index" in cmd and "--no-deps" in cmd
    fetch = sweep.wheel_command(tmp_path, "datasets", sweep.WHEELS["datasets"])
    assert fetch[-1] == "datasets==5.2.0" and "--only-binary=:all:" in fetch and "3.12" in fetch


def test_runs_that_differ_only_in_their_steps_merge_into_one_file(tmp_path):
    import run

    old = {"config": {"model": "m", "warmup": 2, "steps": 5}, "commit": "old", "machine_file": "a.yaml",
           "figures": [{"system": "slide", "mode": "1.0", "step_s": 1.0}, {"system": "slide", "mode": "none"}]}
    (tmp_path / "b8.json").write_text(json.dumps(old))
    new = {"config": {"model": "m", "warmup": 1, "steps": 3}, "figures": [
        {"system": "slide", "mode": "none", "warmup": 1, "steps": 3}]}
    merged = run.merge(tmp_path / "b8.json", new)
    assert merged["figures"] == [{"system": "slide", "mode": "1.0", "step_s": 1.0, "commit": "old",
                                  "machine_file": "a.yaml", "warmup": 2, "steps": 5},
                                 {"system": "slide", "mode": "none", "warmup": 1, "steps": 3}]
    other = {"config": {"model": "other", "warmup": 2, "steps": 5}, "figures": []}
    assert run.merge(tmp_path / "b8.json", other)["figures"] == []  # (another shape replaces)


def test_a_wheel_larger_than_one_run_travels_in_parts_and_is_joined_once_all_arrived(tmp_path, monkeypatch):
    """--fetch-wheels cuts a wheel over PART_BYTES into parts, each in a folder beside the wheels' own; a run that
    carries some of them keeps them in the stage (a warm machine keeps it), and the run that brings the last joins
    them into the very wheel, which the sitting installs with the others."""
    monkeypatch.setattr(sweep, "PART_BYTES", 1000)
    wheels = tmp_path / ".whl"
    wheels.mkdir()
    big = bytes(range(256)) * 10  # 2,560 bytes: three parts
    (wheels / "big_libs-1.0-py3-none-any.whl").write_bytes(big)
    (wheels / "small-1.0-py3-none-any.whl").write_bytes(b"small")
    parts = sweep.split_wheel(wheels / "big_libs-1.0-py3-none-any.whl", sweep.parts_dirs(wheels))
    assert [p.parent.name for p in parts] == [".whl-2", ".whl-3", ".whl-4"]
    assert not (wheels / "big_libs-1.0-py3-none-any.whl").exists()
    assert max(p.stat().st_size for p in parts) <= 1000

    stage = tmp_path / "stage"
    carried = tmp_path / "first-run" / ".whl"  # the first run carries two parts only
    for p in parts[:2]:
        (carried.parent / p.parent.name).mkdir(parents=True, exist_ok=True)
        (carried.parent / p.parent.name / p.name).write_bytes(p.read_bytes())
    assert sweep.gather_parts(carried, stage) == []
    second = tmp_path / "second-run" / ".whl"  # the next, the wheels' folder and the last part
    second.mkdir(parents=True)
    (second / "small-1.0-py3-none-any.whl").write_bytes(b"small")
    (second.parent / ".whl-4").mkdir()
    (second.parent / ".whl-4" / parts[2].name).write_bytes(parts[2].read_bytes())
    (joined,) = sweep.gather_parts(second, stage)
    assert joined.name == "big_libs-1.0-py3-none-any.whl" and joined.read_bytes() == big

    monkeypatch.setattr(sweep, "WHEEL_STAGE", stage)
    monkeypatch.setattr(sweep, "WHEEL_SITE", tmp_path / "site")
    monkeypatch.setattr(sweep, "missing_here", lambda names: ["big-libs", "small"])
    ran = []
    monkeypatch.setattr(sweep.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(
        cmd, 0))
    (tmp_path / "site").mkdir()
    assert sorted(sweep.install_wheels(second)) == ["big-libs", "small"]
    assert str(joined) in ran[0] and str(second / "small-1.0-py3-none-any.whl") in ran[0]
    # the site reads its .pth files (the CuTe DSL's puts its packages on the path)
    assert "site.addsitedir" in (tmp_path / "site" / "sitecustomize.py").read_text()
