"""What a run reports: metrics.jsonl (one JSON object per optimizer step), TensorBoard scalars, a loss plot."""

from __future__ import annotations

import json
import os
import pathlib
import resource
import warnings

import torch


def host_rss_gib() -> float:
    """Resident set size of this process now (falls back to the peak where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def gpu_peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


class MetricsLog:
    def __init__(self, run_dir: pathlib.Path, tensorboard: bool = True, first_step: int = 1, writes: bool = True):
        """`first_step`: the step logged next; TensorBoard hides events of that step and later that an earlier
        course of the run wrote (a resume from an older checkpoint redoes them). `writes`: False for the ranks
        of a data-parallel run but the first, whose records would repeat its global figures."""
        self.path = run_dir / "metrics.jsonl"
        # (stays open for the run, closed by close())
        self._file = open(self.path, "a") if writes else None  # noqa: SIM115
        self._tb = None
        if tensorboard and writes:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # a declared dependency; only a hand-made environment lacks it
                warnings.warn(f"no TensorBoard logs: {e}", stacklevel=2)
            else:
                self._tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=first_step)

    def write(self, record: dict) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: pathlib.Path) -> list[dict]:
    """The records of a metrics.jsonl; a line that does not parse (a crash mid-write) is skipped with a warning."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                warnings.warn(f"{path}:{number} is not a complete record (a write cut short?): skipped", stacklevel=2)
    return rows


def plot_loss(metrics_path: pathlib.Path, out: pathlib.Path) -> pathlib.Path | None:
    rows = read_metrics(metrics_path)
    if not rows:
        return None
    try:
        import matplotlib
    except ImportError as e:
        warnings.warn(f"no loss plot: {e}", stacklevel=2)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    train = [r for r in rows if "loss" in r]
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    evals = [r for r in rows if "eval_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def step_figures(record: dict, on_gpu: bool) -> str:
    """A step's figures as its progress line shows them; a run on the CPU has no GPU memory to show."""
    gpu = f"gpu {record['gpu_peak_gib']:.1f} GiB | " if on_gpu else ""
    return (f"loss {record['loss']:.3f} | {record['tokens_per_s']:,.0f} tok/s | {record['tflops']:.2f} TFLOP/s | "
            f"{gpu}host {record['host_rss_gib']:.1f} GiB")
