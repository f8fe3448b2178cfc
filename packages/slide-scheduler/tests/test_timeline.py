"""The per-step timeline summary against a count over unit time cells, and its split of exposed time in a run."""

from __future__ import annotations

import random

import pytest
import torch
from test_engine import Model, ToyStack, batches, make_engine

from slide_memory import AdamWConfig
from slide_scheduler.run.timeline import Span, summarize


def cells(spans: list[Span], lane: str) -> set[int]:
    return {t for s in spans if s.lane == lane for t in range(int(s.start), int(s.end))}


@pytest.mark.parametrize("seed", range(20))
def test_summary_counts_what_a_cell_by_cell_count_gives(seed):
    """Random overlapping spans on whole-number times: busy, exposed and its split into CPU-update waits and the
    rest equal counts of unit cells (a cell is exposed when no compute span covers it, and CPU-update exposed
    when a `waits` span covers it too)."""
    rng = random.Random(seed)
    wall = 60
    spans = []
    for lane, count in (("compute", 8), ("waits", 4), ("h2d", 5), ("land", 3), ("d2h", 4), ("store", 3),
                        ("optimizer", 3), ("disk", 3)):
        for _ in range(count):
            # (host optimizer spans may start before the step; compute and waits are inside it)
            a = rng.randrange(-5 if lane == "optimizer" else 0, wall - 14)
            spans.append(Span(lane, "x", float(a), float(a + rng.randrange(1, 15))))
    got = summarize(spans, float(wall))
    busy = cells(spans, "compute")
    exposed = set(range(wall)) - busy
    waiting = exposed & cells(spans, "waits")
    assert got["gpu_busy_s"] == pytest.approx(len(busy))
    assert got["exposed_s"] == pytest.approx(len(exposed))
    assert got["exposed_update_s"] == pytest.approx(len(waiting))
    assert got["exposed_transfer_s"] == pytest.approx(len(exposed) - len(waiting))
    assert got["copy_busy_s"] == pytest.approx(len(cells(spans, "h2d") | cells(spans, "d2h") | cells(spans, "store")))
    assert got["update_busy_s"] == pytest.approx(len(cells(spans, "optimizer")))
    assert got["disk_busy_s"] == pytest.approx(len(cells(spans, "disk")))


def test_a_wait_counts_only_where_the_gpu_had_nothing_to_do():
    """Compute at [0, 1), [2, 3), [5, 6) of a 7 s step; the engine's thread blocked on updates over [0.5, 2.5)
    and [4, 4.5). Exposed: [1, 2), [3, 5), [6, 7); of it, CPU-update exposed: [1, 2) and [4, 4.5)."""
    spans = [Span("compute", "c", a, a + 1) for a in (0.0, 2.0, 5.0)]
    spans += [Span("waits", "w", 0.5, 2.5), Span("waits", "w", 4.0, 4.5)]
    got = summarize(spans, 7.0)
    assert (got["gpu_busy_s"], got["exposed_s"]) == (3.0, 4.0)
    assert (got["exposed_update_s"], got["exposed_transfer_s"]) == (1.5, 2.5)


def timeline_of(slow: str, pipeline: bool = True) -> dict[str, float]:
    torch.manual_seed(0)
    engine = make_engine(ToyStack(Model(tied=True)),
        device="cpu", window=2, max_grad_norm=0.05, device_update_share=0.0, optimizer=AdamWConfig(lr=1e-2),
        pipeline=pipeline)
    getattr(engine, slow).delay = 0.02
    for step in batches(seed=4, steps=2, micro=2):
        stats = engine.step(step, lr=1e-2, normalizer=10)
    engine.close()
    return stats.timeline


def test_exposed_time_is_split_between_host_updates_and_transfers():
    """A slow host optimizer (clipped updates run under the next forward) shows as exposed CPU-update time; a
    slow host-to-device lane as exposed transfer time; in the synchronous schedule, updates run inline on the
    engine's thread, and all of their time is exposed CPU-update time. The two parts add up to the exposed
    time."""
    update_bound, copy_bound = timeline_of("updater"), timeline_of("h2d")
    inline = timeline_of("d2h", pipeline=False)  # (the updater's test delay is not update work)
    assert inline["exposed_update_s"] == pytest.approx(inline["update_busy_s"]) and inline["update_busy_s"] > 0
    for t in (update_bound, copy_bound, inline):
        assert t["exposed_update_s"] + t["exposed_transfer_s"] == pytest.approx(t["exposed_s"])
    assert update_bound["exposed_update_s"] > 0.05 and update_bound["exposed_update_s"] > update_bound[
        "exposed_transfer_s"]
    assert copy_bound["exposed_transfer_s"] > 0.05 and copy_bound["exposed_transfer_s"] > copy_bound[
        "exposed_update_s"]
