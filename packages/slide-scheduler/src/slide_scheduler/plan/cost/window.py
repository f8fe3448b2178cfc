"""The window's overlap: when a pass's compute ends as its blocks slide through the device slots, and what the
compute waited for."""

from __future__ import annotations

from ..placement import Placement


def slide(loads: list[float], compute: list[float], ready: list[float], window: int,
          resident: list[bool]) -> tuple[float, dict[str, float]]:
    """When the last of these blocks (in running order) finishes: each sliding one loads after the previous load
    and once the slot it takes (`window` sliding blocks back) is free and its update is `ready`; each runs after
    the previous one and its own load. Also how long the compute waited: for `updates` where the late load had
    waited for its block's update, for `loads` otherwise."""
    load_end, done = 0.0, 0.0
    waits = {"loads": 0.0, "updates": 0.0}
    finished: list[float] = []  # compute end of each sliding block, in order
    for load, run, at, res in zip(loads, compute, ready, resident):
        if res:
            done += run
            continue
        slot_free = finished[-window] if len(finished) >= window else 0.0
        cause = "updates" if at > max(load_end, slot_free) else "loads"
        load_end = max(load_end, slot_free, at) + load
        if load_end > done:
            waits[cause] += load_end - done
        done = max(done, load_end) + run
        finished.append(done)
    return done, waits


def forward_pass(p: Placement, loads: list[float], compute: list[float],
                 ready: list[float]) -> tuple[float, dict[str, float]]:
    """The forward: blocks in order, each load also waiting for its block's host update where that is `ready`
    only then (deferred)."""
    resident = [unit.resident for unit in p.units[1:]]
    return slide(loads, compute, ready, p.window, resident)


def backward_pass(p: Placement, loads: list[float], compute: list[float]) -> tuple[float, dict[str, float]]:
    """The backward: blocks in reverse; host updates follow their gradients on the host thread and hold back no
    load."""
    resident = [unit.resident for unit in p.units[1:]]
    return slide(loads[::-1], compute[::-1], [0.0] * len(loads), p.window, resident[::-1])
