"""Each lane's rate, from the machine file's measured figures and the few constants the cost model adds to them."""

from __future__ import annotations

from dataclasses import dataclass

from ..attention import chosen, rate_of
from ..machine import Machine
from ..placement import Placement

# A decoder block's fwd+bwd runs at this share of the machine's dense bf16 matmul rate (attention, norms and
# element-wise kernels between the GEMMs)
BLOCK_EFFICIENCY = 0.71
CPU_FLOPS_PER_CORE = 2e10  # fp32 on a CPU device
# The host AdamW rate beside a step's DMA copies, as a share of the machine file's (measured alone), where the
# file does not say (`host.adamw_beside_copies`): the fused kernel is bound by host memory, which the copies share
# (docs/findings.md)
ADAMW_BESIDE_COPIES = 0.73


@dataclass(frozen=True)
class Rates:
    """One placement's lanes on one machine: FLOP/s, bytes/s and parameters/s."""

    pcie: bool  # whether copies cross PCIe (a CPU device copies within host memory)
    gemms: float  # a block's GEMMs (FLOP/s)
    attention: float  # causal attention, in causal_attention_flops' count
    block_attention: tuple[float, ...]  # each block's, on the backend chosen for it (empty: all at `attention`)
    experts: float  # a mixture's routed experts; 0: as the GEMMs
    h2d: float
    d2h: float
    duplex: float  # both directions at once, together
    link: float  # one GPU's collectives with the other ranks'
    memory: float  # host memory
    adamw: float  # host AdamW, parameters per second
    drives: tuple[tuple[float, float], ...]  # each drive of the disk tier: (read, write) bytes per second


def per_second(gbps: float) -> float:
    """GB/s as bytes per second; a rate not measured (0) stands for a very slow one."""
    return max(gbps, 1e-3) * 1e9


def rates_of(p: Placement, machine: Machine) -> Rates:
    g, host, link, drives = machine.gpu, machine.host, machine.pcie, machine.drives
    if p.drive_count > len(drives):
        raise ValueError(f"the placement stripes the disk tier over {p.drive_count} drives, the machine file lists "
                         f"{len(drives)}")
    pcie = not p.device_is_host
    gemms = (g.bf16_tflops * 1e12 * BLOCK_EFFICIENCY if pcie and machine.has_gpu
             else CPU_FLOPS_PER_CORE * max(1, host.cores))
    attention = g.attention_tflops * 1e12 if pcie and g.attention_tflops else gemms
    backends = chosen(p.shapes, g, p.query_tiles and p.tiled) if pcie else ()
    return Rates(
        pcie=pcie, gemms=gemms,
        # attention and routed experts at their own rates where the machine file has them
        attention=attention,
        block_attention=tuple(rate_of(g, b, p.shapes.head_dim) * 1e12 or attention for b in backends),
        experts=g.experts_tflops * 1e12 if pcie and g.experts_tflops else 0.0,
        h2d=per_second(link.h2d_gbps), d2h=per_second(link.d2h_gbps),
        duplex=per_second(max(link.duplex_gbps, link.h2d_gbps, link.d2h_gbps)),
        link=per_second(g.link_gbps or link.h2d_gbps), memory=per_second(host.memory_gbps),
        adamw=per_second(host.adamw_gparams) * (host.adamw_beside_copies if pcie else 1.0),
        drives=tuple((per_second(d.read_gbps), per_second(d.write_gbps)) for d in drives))
