"""Every combination of the run's settings the config allows, on a CPU: each is planned, and a pairwise-covering
subset trains two steps; each either runs or is refused with one line (exit 2), never a traceback."""

from __future__ import annotations

import itertools
import json

import pytest

from slide_train.cli import main

AXES = {
    "engine.compute_dtype": ("auto", "bf16", "fp32"),
    "engine.states_dtype": ("fp32", "bf16"),
    "engine.activation_offload": ("auto", "gpu", "host", "disk"),
    "engine.nvme.fraction": ("0", "0.5", "1", "auto"),
    "max_grad_norm": ("1.0", "null", "1e6"),  # clipping that acts, none, clipping that never acts
    "engine.placement.speculate": ("true", "false", "auto"),
}
SMALL = ["--engine.device=cpu", "--seq_len=32", "--micro_batch_size=2", "--grad_accum=2"]


def every_combination() -> list[dict[str, str]]:
    return [dict(zip(AXES, values)) for values in itertools.product(*AXES.values())]


def pairwise() -> list[dict[str, str]]:
    """A small set of combinations in which every pair of values of two axes appears at least once (greedy: each
    pick covers the most pairs not yet covered; ties go to the first in product order, so the set is fixed)."""
    keys = list(AXES)
    uncovered = {((a, x), (b, y)) for a, b in itertools.combinations(keys, 2) for x in AXES[a] for y in AXES[b]}
    chosen = []
    candidates = every_combination()

    def gain(c: dict) -> int:
        return sum(((a, c[a]), (b, c[b])) in uncovered for a, b in itertools.combinations(keys, 2))

    while uncovered:
        best = max(candidates, key=gain)
        chosen.append(best)
        uncovered -= {((a, best[a]), (b, best[b])) for a, b in itertools.combinations(keys, 2)}
    return chosen


def args_of(combo: dict[str, str]) -> list[str]:
    return [f"--{k}={v}" for k, v in combo.items()]


def outcome(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def assert_ran_or_refused_in_one_line(code: int, err: str, combo: dict) -> None:
    assert "Traceback" not in err, (combo, err)
    errors = [line for line in err.splitlines() if line.startswith("slide-train: error:")]
    if code == 0:
        assert not errors, (combo, err)
    else:
        assert code == 2 and len(errors) == 1, (combo, code, err)


def test_the_pairwise_set_covers_every_pair():
    chosen = pairwise()
    for a, b in itertools.combinations(AXES, 2):
        assert {(c[a], c[b]) for c in chosen} == set(itertools.product(AXES[a], AXES[b])), (a, b)
    assert len(chosen) < len(every_combination()) // 20


def test_every_combination_is_planned_or_refused_in_one_line(tmp_path, capsys):
    seen = {0: 0, 2: 0}
    for combo in every_combination():
        code, out, err = outcome(capsys, ["plan", "--json", f"--output_dir={tmp_path / 'run'}", *SMALL,
                                          *args_of(combo)])
        assert_ran_or_refused_in_one_line(code, err, combo)
        seen[code] += 1
        if code == 0:
            plan = json.loads(out)
            assert plan["fits"], combo
            # the plan's facts are the config's: clipping, and the activation tier asked for (or one chosen)
            asked = combo["engine.activation_offload"]
            run = plan["run"]
            assert run["activations"] in ("gpu", "host", "disk") and asked in ("auto", run["activations"]), combo
            assert run["compute_bytes"] == (2 if combo["engine.compute_dtype"] == "bf16" else 4), combo
            assert run["state_bytes"] == (2 if combo["engine.states_dtype"] == "bf16" else 4), combo
            assert run["clip"] == (None if combo["max_grad_norm"] == "null" else float(combo["max_grad_norm"]))
    assert seen[0] > 0


@pytest.mark.parametrize("combo", pairwise(), ids=lambda c: "-".join(c.values()))
def test_a_pairwise_covering_set_trains_two_steps_or_is_refused_in_one_line(tmp_path, capsys, combo):
    code, out, err = outcome(capsys, ["finetune", "--no-progress", "--steps=2", "--export=false",
                                      "--checkpoint.keep=0", f"--output_dir={tmp_path / 'run'}", *SMALL,
                                      *args_of(combo)])
    assert_ran_or_refused_in_one_line(code, err, combo)
    if code == 0:
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] > 0 for r in rows), combo
