"""A machine as the cost model sees it: memory sizes and the measured rates of every lane a step uses.

The same figures a machine file holds (`slide-train probe` measures them; docs/machines/ has examples):

    gpu:  {memory_gib, bf16_tflops, attention_tflops, sdpa_tflops, fa4_tflops, flex_tflops, experts_tflops,
           link_gbps}
    host: {memory_gib, cores, memory_gbps, adamw_gparams, adamw_beside_copies}
    pcie: {h2d_gbps, d2h_gbps, duplex_gbps}
    disk: {free_gib, read_gbps, write_gbps, path, path_reason, posix_read_gbps, posix_write_gbps,
           kvikio_read_gbps, kvikio_write_gbps, tbw, dir}

or, for a disk tier striped over several drives, `disks:` in place of `disk:`, a list of such sections, each
naming its drive's folder (`dir`). A RAID 0 array the system already stripes is one drive (`disk:`).

Rates are what a step can get (GB/s are 1e9 bytes per second, TFLOP/s are dense bf16 matrix work), sizes are GiB.
Every figure is a number except the disk's path and its reason, which are words.

`gpu.attention_tflops` is causal attention's rate, forward and backward at a long sequence through the fused
kernels a step runs (SDPA's flash path, FlexAttention), in FLOPs as `causal_attention_flops` counts them: the
FLOPs of a layer's attention over a row, divided by this rate, are its seconds. 0: not measured.

`gpu.sdpa_tflops`, `fa4_tflops` and `flex_tflops` are each attention backend's own rate in the same count, at
head_dim 256 (Gemma's), soft-capped at 50 where the backend can soft-cap (SDPA cannot): the rate of a layer whose
head_dim is over 128 on the backend the plan chose for it. 0: not measured (such layers take `attention_tflops`).

`gpu.experts_tflops` is a mixture of experts' routed MLP's rate, forward and backward: routing, dispatch by
expert, the experts' grouped GEMMs and the weighted combine, in FLOPs as `routed_expert_flops` counts them (the
experts' GEMMs alone). A block's routed experts take their FLOPs over this rate. 0: not measured, priced as the
dense GEMMs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Gpu:
    memory_gib: float = 0.0  # 0: no GPU (the device is the CPU)
    bf16_tflops: float = 0.0
    # causal attention forward + backward (bf16, fused kernels, long rows) in `causal_attention_flops`' count;
    # 0: not measured
    attention_tflops: float = 0.0
    # each attention backend's rate at head_dim 256, soft-capped where it can, in the same count; 0: not measured
    sdpa_tflops: float = 0.0
    fa4_tflops: float = 0.0
    flex_tflops: float = 0.0
    # a mixture's routed MLP forward + backward (bf16, grouped GEMMs) in `routed_expert_flops`' count; 0: not
    # measured
    experts_tflops: float = 0.0
    # what one GPU's collectives with the others move (NVLink, or PCIe between GPUs), for data-parallel ranks;
    # 0: not measured, priced at the host link's rate
    link_gbps: float = 0.0


def causal_attention_flops(seq_len: int, heads: int, head_dim: int, batch: int = 1, backward: bool = True) -> float:
    """Causal self-attention's FLOPs for one layer over `batch` rows of `seq_len` tokens, as the trainer's
    `tflops_attn` counts them (PaLM's count with the causal half; slide_train.trainer.attention_flops_per_token):

        forward   2 matmuls (Q K^T, P V) x 2 FLOPs a multiply-add x S x S x heads x head_dim / 2 (causal)
                  = 2 * batch * S**2 * heads * head_dim
        backward  2 x the forward (`backward`): 6 * batch * S**2 * heads * head_dim in all, which is the
                  trainer's 6 x heads x head_dim x S per token and layer.

    `heads` are the query heads (grouped key/value heads do not change the count). A flash kernel's backward
    does 2.5x the forward's matmuls (it recomputes the scores), so `Gpu.attention_tflops`, which is measured in
    this count, stands for somewhat more arithmetic than it says: the count, not the kernel, defines it.
    """
    forward = 2.0 * batch * float(seq_len) ** 2 * heads * head_dim
    return 3 * forward if backward else forward


def routed_expert_flops(tokens: int, expert_numel: int, top_k: int, backward: bool = True) -> float:
    """The FLOPs of a mixture's routed experts for `tokens` tokens, each routed to `top_k` experts of
    `expert_numel` parameters (gate, up and down): 2 per parameter and routed token forward, the backward at 2x
    (the gradients of the input and the weights). The router and the combine are left out of the count."""
    forward = 2.0 * tokens * top_k * expert_numel
    return 3 * forward if backward else forward


@dataclass(frozen=True)
class Host:
    memory_gib: float = 16.0
    cores: int = 2
    # what host memory moves under a step's mix: DMA copies both ways beside the AdamW threads (every byte read
    # or written counted once)
    memory_gbps: float = 10.0
    adamw_gparams: float = 0.1  # fused AdamW over fp32 masters, billions of parameters per second
    # the share of that rate it keeps beside a step's DMA copies both ways (the fused kernel is bound by host
    # memory, which the copies share); the probe measures it, files without it take 0.73, an H200 host's
    adamw_beside_copies: float = 0.73


@dataclass(frozen=True)
class Pcie:
    h2d_gbps: float = 0.0
    d2h_gbps: float = 0.0
    duplex_gbps: float = 0.0  # both directions at once, together


@dataclass(frozen=True)
class Disk:
    free_gib: float = 0.0
    read_gbps: float = 0.5  # of the path the disk tier takes (`path`)
    write_gbps: float = 0.5
    # slide-io's NVMe path chosen from the probe's measurement ("posix", "kvikio-compat", "gds") and why; "": not
    # measured (the store then takes its default)
    path: str = ""
    path_reason: str = ""
    # each path's rates as the probe measured them; 0: not measured (kvikio cannot run here)
    posix_read_gbps: float = 0.0
    posix_write_gbps: float = 0.0
    kvikio_read_gbps: float = 0.0
    kvikio_write_gbps: float = 0.0
    # the drive's rated endurance in terabytes written (1e12 bytes), from its data sheet (0: not given); a plan that
    # writes to the disk tier says how many steps it lasts
    tbw: float = 0.0
    # the folder on this drive the disk tier writes to (a run matches its folders to drives by it); "": not named
    dir: str = ""


@dataclass(frozen=True)
class Machine:
    gpu: Gpu = field(default_factory=Gpu)
    host: Host = field(default_factory=Host)
    pcie: Pcie = field(default_factory=Pcie)
    disk: Disk = field(default_factory=Disk)  # the one drive, or the first of `disks`
    # the drives the disk tier stripes over, where there are several (empty: `disk` alone)
    disks: tuple[Disk, ...] = ()

    def __post_init__(self):
        if self.disks:  # (`disk` stands for the first drive wherever one figure is asked for)
            object.__setattr__(self, "disks", tuple(self.disks))
            object.__setattr__(self, "disk", self.disks[0])

    @property
    def has_gpu(self) -> bool:
        return self.gpu.memory_gib > 0

    @property
    def drives(self) -> tuple[Disk, ...]:
        """Every drive of the disk tier, in the order a placement numbers them."""
        return self.disks or (self.disk,)

    def with_drives(self, drives: list[Disk] | tuple[Disk, ...]) -> Machine:
        """This machine with the disk tier on `drives` (one: the single `disk` form)."""
        drives = tuple(drives)
        if len(drives) == 1:
            return dataclasses.replace(self, disk=drives[0], disks=())
        return dataclasses.replace(self, disk=drives[0], disks=drives)

    def to_dict(self) -> dict[str, Any]:
        """The machine file's sections: `disks` (a list) where there are several drives, else `disk`."""
        out = {name: dataclasses.asdict(getattr(self, name)) for name in ("gpu", "host", "pcie")}
        if self.disks:
            out["disks"] = [dataclasses.asdict(d) for d in self.disks]
        else:  # (a single drive's folder is the run's engine.nvme.dir: a file names it only where it was given)
            out["disk"] = {k: v for k, v in dataclasses.asdict(self.disk).items() if k != "dir" or v}
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "machine file") -> Machine:
        """A machine from the four sections of a machine file; every key must be known, every figure a
        non-negative number and every word a string (a section or key left out keeps its default). `disks`, a
        list of disk sections each with its `dir`, stands in for `disk`."""
        if not isinstance(values, dict):
            raise ValueError(f"{source}: expected a mapping with sections gpu, host, pcie, disk")
        kinds = {"gpu": Gpu, "host": Host, "pcie": Pcie, "disk": Disk}
        if "disk" in values and "disks" in values:
            raise ValueError(f"{source}: give either disk (one drive) or disks (a list of drives), not both")
        built: dict[str, Any] = {}
        for name, body in values.items():
            if name == "disks":
                built[name] = _drives(body, source)
                continue
            if name not in kinds:
                raise ValueError(f"{source}: unknown section {name!r} (sections: {', '.join(kinds)}, disks)")
            built[name] = _section(kinds[name], name, body, source)
        return cls(**built)


def _drives(body: Any, source: str) -> tuple[Disk, ...]:
    """The `disks` list: a disk section per drive, each naming its folder."""
    if not isinstance(body, list) or not body:
        raise ValueError(f"{source}: disks must be a list of drives, each a mapping such as "
                         f"{{dir: /mnt/nvme0, read_gbps: 7.0, write_gbps: 6.0}}, got {body!r}")
    drives = tuple(_section(Disk, f"disks[{i}]", drive, source) for i, drive in enumerate(body))
    for i, drive in enumerate(drives):
        if not drive.dir:
            raise ValueError(f"{source}: disks[{i}] needs dir, the folder on that drive the disk tier writes to")
    dirs = [d.dir for d in drives]
    if len(set(dirs)) < len(dirs):
        raise ValueError(f"{source}: disks name a folder twice ({', '.join(dirs)})")
    return drives


def _section(kind: type, name: str, body: Any, source: str):
    """One section's figures as `kind`: known keys, numbers at least 0, words as strings."""
    if not isinstance(body, dict):
        raise ValueError(f"{source}: section {name} must be a mapping of figures, got {body!r}")
    known = {f.name: f for f in dataclasses.fields(kind)}
    figures = {}
    for key, value in body.items():
        if key not in known:
            raise ValueError(f"{source}: unknown key {name}.{key} (keys: {', '.join(known)})")
        if known[key].type in (str, "str"):
            if not isinstance(value, str):
                raise ValueError(f"{source}: {name}.{key} must be a string, got {value!r}")
            figures[key] = value
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{source}: {name}.{key} must be a number of at least 0, got {value!r}")
        figures[key] = int(value) if key == "cores" else float(value)
    return kind(**figures)
