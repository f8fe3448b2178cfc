"""Per-step timeline: when each lane was busy, so a step's time splits into GPU compute and exposed waits.

Spans on a CUDA lane are event pairs read after the step's final synchronization; spans on a host thread (CPU
lanes, the optimizer worker, the engine's thread blocked on it: `waits`) are `perf_counter` pairs. All are placed
relative to the step's start. The same spans give the step's summary figures, a Chrome / Perfetto trace and a PNG.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class Span:
    lane: str
    label: str
    start: float  # seconds from the step's start
    end: float


class Timeline:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._open: list[tuple[str, str, object, object]] = []
        self._origin_event = None
        self._origin = 0.0

    def begin(self) -> None:
        self._open.clear()
        self._origin = time.perf_counter()
        if self.cuda:
            self._origin_event = torch.cuda.Event(enable_timing=True)
            self._origin_event.record()

    def _mark(self, stream):
        if self.cuda and stream is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
            return event
        return time.perf_counter()

    @contextmanager
    def span(self, lane: str, label: str, stream=None):
        """Time the work queued (CUDA) or done (host) inside the block."""
        start = self._mark(stream)
        yield
        self._open.append((lane, label, start, self._mark(stream)))

    def add_host(self, lane: str, label: str, start: float, end: float) -> None:
        self._open.append((lane, label, start, end))

    def spans(self) -> list[Span]:
        """Resolve every span (call after the step's work has finished)."""
        out = []
        for lane, label, start, end in self._open:
            out.append(Span(lane, label, self._seconds(start), self._seconds(end)))
        return out

    def _seconds(self, mark) -> float:
        if isinstance(mark, float):
            return mark - self._origin
        return self._origin_event.elapsed_time(mark) / 1000.0


def summarize(spans: list[Span], wall: float) -> dict[str, float]:
    """GPU busy time (union of compute spans) and what is left of the step: exposed time, split by what it was
    spent on. Exposed CPU-update time is the GPU's idle time while the engine's thread was blocked on the host
    optimizer (spans of the `waits` lane), so it could not queue more work; it counts whole even where a transfer
    was also late. The rest is exposed transfer time: compute waiting on the copy and land lanes (streamed device
    updates included), and launches. Also the busy time of the copy lanes (h2d, d2h, store) together, of the land
    lane (its kernels; before it existed they ran inside h2d spans), of the host optimizer and of the NVMe tier's
    reads and writes (`disk`)."""
    busy = _merged([(s.start, s.end) for s in spans if s.lane == "compute"])
    idle = _between(busy, 0.0, wall)
    waits = _merged([(s.start, s.end) for s in spans if s.lane == "waits"])
    exposed_update = _measure(_intersect(idle, waits))
    exposed = _measure(idle)
    return {"gpu_busy_s": _measure(busy), "exposed_s": exposed, "exposed_update_s": exposed_update,
            "exposed_transfer_s": max(0.0, exposed - exposed_update),
            "copy_busy_s": _union([(s.start, s.end) for s in spans if s.lane in ("h2d", "d2h", "store")]),
            "land_busy_s": _union([(s.start, s.end) for s in spans if s.lane == "land"]),
            "update_busy_s": _union([(s.start, s.end) for s in spans if s.lane == "optimizer"]),
            "disk_busy_s": _union([(max(s.start, 0.0), min(s.end, wall)) for s in spans  # (within the step)
                                   if s.lane == "disk" and s.end > 0.0 and s.start < wall])}


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals as sorted, disjoint intervals."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _between(merged: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """What `merged` leaves of [start, end)."""
    out, at = [], start
    for a, b in merged:
        if a > at:
            out.append((at, min(a, end)))
        at = max(at, b)
        if at >= end:
            break
    if at < end:
        out.append((at, end))
    return [(a, b) for a, b in out if b > a]


def _intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intersection of two sorted, disjoint interval lists."""
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def _measure(intervals: list[tuple[float, float]]) -> float:
    return sum((b - a for a, b in intervals), 0.0)


def _union(intervals: list[tuple[float, float]]) -> float:
    return _measure(_merged(intervals))


def write_trace(spans: list[Span], path) -> None:
    """Chrome trace-event JSON (open in https://ui.perfetto.dev or chrome://tracing)."""
    lanes = sorted({s.lane for s in spans})
    events = [{"name": s.label, "ph": "X", "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6, "pid": 0,
               "tid": lanes.index(s.lane)} for s in spans]
    events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": lane}}
               for i, lane in enumerate(lanes)]
    with open(path, "w") as f:
        json.dump({"traceEvents": events}, f)


def plot(spans: list[Span], path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = ["compute", "h2d", "land", "d2h", "store", "disk", "optimizer", "waits"]
    lanes = [lane for lane in order if any(s.lane == lane for s in spans)]
    colors = {"forward": "tab:blue", "backward": "tab:orange", "tail": "tab:green", "head": "tab:purple",
              "params": "tab:gray", "acts": "tab:olive", "grads": "tab:red", "update": "tab:brown",
              "waiting": "tab:pink", "store": "tab:brown", "read": "tab:cyan", "write": "tab:olive"}
    fig, ax = plt.subplots(figsize=(12, 0.6 + 0.5 * len(lanes)))
    for row, lane in enumerate(lanes):
        for s in spans:
            if s.lane == lane:
                kind = s.label.split()[0]
                ax.broken_barh([(s.start * 1e3, max((s.end - s.start) * 1e3, 0.01))], (row - 0.4, 0.8),
                               color=colors.get(kind, "tab:cyan"))
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("ms from step start")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class PhaseClock:
    """Host time between a step's phase boundaries (`lap`); `sync`: each lap waits for the device first (the
    synchronous schedule)."""

    def __init__(self, device: torch.device, sync: bool):
        self.sync = torch.cuda.synchronize if device.type == "cuda" and sync else (lambda: None)
        self.start = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}
        self.memory: dict[str, float] = {}

    def lap(self, name: str) -> None:
        self.sync()
        now = time.perf_counter()
        self.laps[name] = now - self.last
        self.last = now

    @property
    def total(self) -> float:
        return self.last - self.start


def memory_counters(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {"allocated_bytes_at_start": float(stats.get("allocated_bytes.all.current", 0)),
            "alloc_retries": float(stats.get("num_alloc_retries", 0)),
            "cuda_mallocs": float(stats.get("segment.all.allocated", 0))}


def drain_spans(spans: list[tuple[str, float, float]], origin: float) -> list[tuple[str, float, float]]:
    """Take the (label, start, end) host spans a worker thread has appended so far, as times from `origin`,
    dropping those that ended before it. The worker may append meanwhile: only what was read is removed."""
    seen = list(spans)
    del spans[: len(seen)]
    return [(label, start - origin, end - origin) for label, start, end in seen if end >= origin]
