"""The window's overlap: when a pass's compute ends as its blocks slide through the device slots, what the compute
waited for, and how long the copies to the device idled for updates."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..placement import Placement


@dataclass
class PassTimes:
    """One pass over the blocks: when its compute ends, what the compute waited for (`loads`: the copies;
    `updates`: a load that had waited for its block's update), how long the copies to the device idled waiting
    for updates (`copies_idle`), and when each block's compute ended (block order, from the pass's start)."""

    length: float
    waits: dict[str, float] = field(default_factory=lambda: {"loads": 0.0, "updates": 0.0})
    copies_idle: float = 0.0
    ends: list[float] = field(default_factory=list)


def slide(loads: list[float], compute: list[float], ready: list[float], window: int,
          resident: list[bool], after: list[float] | None = None, lag: list[float] | None = None) -> PassTimes:
    """When the last of these blocks (in running order) finishes: each sliding one loads after the previous load
    and once the slot it takes (`window` sliding blocks back) is free and its update is `ready`; each runs after
    the previous one and its own load. Where a block has copies of its own `after` it runs (an early update: they
    start `lag` after its compute ends), they queue on the copies to the device behind the load `window` blocks
    later (staged first) and ahead of the next one, and the pass lasts until they are done. Also how long the
    compute waited: for `updates` where the late load had waited for its block's update, for `loads` otherwise;
    and how long the copies idled for updates (a load that could have started, its slot free, but for its block's
    update). `ends` are in running order."""
    after, lag = after or [0.0] * len(loads), lag or [0.0] * len(loads)
    load_end, done = 0.0, 0.0
    times = PassTimes(0.0)
    finished: list[float] = []  # compute end of each sliding block, in order
    queued = 0  # blocks whose copies after them are queued

    def copies_after(upto: int) -> float:
        nonlocal queued
        end = load_end
        for k in range(queued, upto):
            if after[k]:
                end = max(end, times.ends[k] + lag[k]) + after[k]
        queued = max(queued, upto)
        return end

    for j, (load, run, at, res) in enumerate(zip(loads, compute, ready, resident)):
        if res:
            done += run
            times.ends.append(done)
            continue
        load_end = copies_after(j - window)
        slot_free = finished[-window] if len(finished) >= window else 0.0
        cause = "updates" if at > max(load_end, slot_free) else "loads"
        times.copies_idle += max(0.0, at - max(load_end, slot_free))
        load_end = max(load_end, slot_free, at) + load
        if load_end > done:
            times.waits[cause] += load_end - done
        done = max(done, load_end) + run
        finished.append(done)
        times.ends.append(done)
    load_end = copies_after(len(loads))
    if load_end > done:
        times.waits["loads"] += load_end - done
    times.length = max(done, load_end)
    return times


def forward_pass(p: Placement, loads: list[float], compute: list[float], ready: list[float]) -> PassTimes:
    """The forward: blocks in order, each load also waiting until its block's host update is `ready` (seconds
    from the forward's start; 0 or less: ready when the forward starts)."""
    resident = [unit.resident for unit in p.units[1:]]
    return slide(loads, compute, ready, p.window, resident)


def backward_pass(p: Placement, loads: list[float], compute: list[float], early: list[float],
                  lag: list[float]) -> PassTimes:
    """The backward: blocks in reverse; host updates follow their gradients on the host thread and hold back no
    load; an early streamed update's copies (`early`) queue on the copies to the device once its gradient is home
    (`lag` after its compute). Its `ends` are in block order."""
    resident = [unit.resident for unit in p.units[1:]]
    times = slide(loads[::-1], compute[::-1], [0.0] * len(loads), p.window, resident[::-1], early[::-1], lag[::-1])
    times.ends.reverse()
    return times
