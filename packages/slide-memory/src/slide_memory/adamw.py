"""AdamW over one flat fp32 master tensor (a unit: a block, or the edges), on the host or on the device.

Each unit's update runs on its own so the engine can overlap it with device work on other units. The math is
torch's fused AdamW kernel, the one `torch.optim.AdamW(fused=True)` runs, so results match a plain torch AdamW
loop bit for bit. Gradients arrive in the compute dtype (bf16) and are widened into a small fp32 scratch, so no
full-size fp32 gradient ever exists. On the host that happens in cache-sized blocks (`BLOCK_PER_THREAD` elements
for each of torch's threads): the widened (and clip-scaled) gradient and bf16 states widened for the step stay in
each core's cache instead of travelling to memory and back, which the host's memory bandwidth, the limit of a CPU
update, would otherwise pay for.

The states are flat tensors allocated up front next to the master (pinned on a CUDA host), so a host unit's
update can also run on the device: `StreamedStep` copies master, states and gradient in, steps there with the
same kernel arithmetic, and copies master and states back (or only the master: see below).

A step may also run in two parts (`part`): "params" writes only the new master (m and v are stepped in scratch
and dropped), "moments" later writes only the new m and v (the master is stepped in scratch). Both parts run the
same kernel on the same inputs, so together they leave exactly the state one whole step leaves; what they buy
is time: the part the next forward waits for moves 18 bytes per parameter (reads 14, writes 4) instead of 26,
and run on a device it sends back 4 bytes per parameter instead of 12.

A "speculate" part changes no state: it steps master, m and v in scratch and writes only the new parameters,
rounded to the dtype of `into`. Run before the step's clip factor is known, as if it were 1, it gives the exact
parameters of the update that follows whenever clipping does not act: the same kernel on the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .host import host_zeros

CHUNK = 1 << 25  # elements per update chunk: the granule of "this part of the gradient has arrived"
# Host elements per thread per kernel call: 1 MiB of fp32 scratch per core (bf16 states and split steps add 2-3
# MiB of m, v and master that are not written back, past some cores' L2 but within the shared cache).
BLOCK_PER_THREAD = 1 << 18


def host_block(chunk: int, threads: int | None = None) -> int:
    """Elements per host kernel call: every thread's share of the scratch stays in its core's cache (`threads`:
    torch's now)."""
    return min(chunk, BLOCK_PER_THREAD * (threads or torch.get_num_threads()))


def scratch_numel(largest: int, host_blocks: bool, threads: int | None = None, chunk: int | None = None) -> int:
    """Elements of the fp32 scratch an AdamW over masters of up to `largest` elements steps through: a chunk, or
    where the host steps in cache-sized blocks (`host_blocks`), a block for `threads` threads."""
    chunk = chunk or CHUNK  # read at call time: tests shrink CHUNK
    return min(host_block(chunk, threads) if host_blocks else chunk, largest)


def host_scratch_bytes(largest: int, threads: int | None = None) -> int:
    """Host bytes of `HostAdamW`'s scratch over masters of up to `largest` elements, shared by every unit: the
    widened gradient and three fp32 rows (m, v and a master not written back)."""
    return 4 * (1 + HOST_ROWS) * scratch_numel(largest, True, threads)


def device_scratch_bytes(numels: list[int], on_cpu: bool, threads: int | None = None) -> int:
    """Bytes of `FlatAdamW`s with fp32 states over device masters of `numels` elements sharing one scratch of a
    chunk (`device_scratch`); on a CPU device each also widens into three fp32 rows of its own."""
    rows = sum(HOST_ROWS * max(1, scratch_numel(n, True, threads)) for n in numels) if on_cpu else 0
    return 4 * (scratch_numel(max(numels), False) + rows)


def device_scratch(numels: list[int], device: torch.device) -> torch.Tensor:
    """The scratch `FlatAdamW`s over device masters of `numels` elements share (one steps at a time)."""
    return torch.empty(scratch_numel(max(numels), False), dtype=torch.float32, device=device)


def streamed_step_bytes(numel: int, grad_bytes: int) -> int:
    """Device bytes of a `StreamedStep`'s buffers of `numel` elements: fp32 master, m, v and widened gradient,
    and the gradient as it lands (`grad_bytes` an element); its step counter besides."""
    return numel * (4 * STREAMED_FP32 + grad_bytes)
# Pieces of a chunk start at multiples of this, where the CPU kernel's vector loops would split it anyway: a
# piece cut elsewhere sends a few elements through scalar code, which can round differently (FMA).
PIECE_ALIGN = 64
PARTS = ("all", "params", "moments", "speculate")
HOST_ROWS = 3  # fp32 rows a host step widens into: m, v and a master that is not written back
STREAMED_FP32 = 4  # fp32 buffers of a streamed step: master, m, v and the widened gradient


@dataclass
class AdamWConfig:
    """AdamW's hyperparameters, the one type for them across the packages (slide-train's `optimizer` keys)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0


def _adamw_kernel(param, grad, exp_avg, exp_avg_sq, step: torch.Tensor, lr: float, config: AdamWConfig) -> None:
    """One AdamW update in place, as update number `step` (already counted): torch's fused kernel, the one
    `torch.optim.AdamW(fused=True)` calls after counting the step (CPU since torch 2.4, CUDA)."""
    torch._fused_adamw_([param], [grad], [exp_avg], [exp_avg_sq], [], [step], lr=lr, beta1=config.betas[0],
                        beta2=config.betas[1], weight_decay=config.weight_decay, eps=config.eps, amsgrad=False,
                        maximize=False)


def _zeros(numel: int, dtype: torch.dtype, device: torch.device, pinned: bool | None) -> torch.Tensor:
    if device.type == "cpu":
        return host_zeros(numel, dtype, pinned)
    return torch.zeros(numel, dtype=dtype, device=device)


class FlatAdamW:
    """AdamW over one flat fp32 master; `step` takes the unit's gradient in any dtype.

    `states_dtype=torch.bfloat16` stores m and v in bf16 (half their memory); each chunk is widened to fp32 for
    the step and rounded back, so the arithmetic stays fp32 and only the stored states lose precision.
    """

    def __init__(self, master: torch.Tensor, config: AdamWConfig, scratch: torch.Tensor | None = None,
                 chunk: int | None = None, states_dtype: torch.dtype = torch.float32,
                 wide: torch.Tensor | None = None, pinned_states: bool | None = None, bounds: tuple[int, ...] = (),
                 external_states: bool = False):
        if master.dtype != torch.float32 or master.dim() != 1:
            raise ValueError("master weights must be a flat fp32 tensor")
        chunk = chunk or CHUNK  # read at call time: tests shrink CHUNK
        self.master, self.config, self.chunk = master, config, chunk
        # Chunks of `chunk` elements, also cut at `bounds`: parts of the unit that are updated at different times
        # (the edges' tail-only parameters) never share a chunk.
        cuts = sorted({0, master.numel(), *(b for b in bounds if 0 < b < master.numel())})
        self.ranges = [(i, min(i + chunk, b)) for a, b in zip(cuts, cuts[1:]) for i in range(a, b, chunk)] or [(0, 0)]
        size = max(1, scratch_numel(master.numel(), master.device.type == "cpu", chunk=chunk))
        self.scratch = scratch if scratch is not None else torch.empty(size, device=master.device)
        self.states_dtype = states_dtype
        self.narrow = states_dtype != torch.float32
        # Host states are page-locked only when they will cross PCIe (StreamedStep); None: whenever CUDA is there.
        # External states (kept elsewhere, e.g. on disk) are bound before each step instead (`bind_states`).
        self.exp_avg = None if external_states else _zeros(master.numel(), states_dtype, master.device, pinned_states)
        self.exp_avg_sq = None if external_states else _zeros(master.numel(), states_dtype, master.device,
                                                              pinned_states)
        # fp32 room for m, v and the master of one block whose step is not written back (or is narrowed after):
        # bf16 states need the first two rows, split steps (host only) all three.
        rows = HOST_ROWS if master.device.type == "cpu" else 2 if self.narrow else 0
        self._wide = wide if wide is not None else torch.zeros(rows, size, device=master.device)
        self.steps = [torch.zeros((), dtype=torch.float32, device=master.device) for _ in self.ranges]

    def bind_states(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, master: torch.Tensor | None = None) -> None:
        """Step with these m and v (flat, the master's length and the states' dtype), and this fp32 master if
        given, from now on: where states kept elsewhere were brought for the step."""
        for t in (exp_avg, exp_avg_sq):
            if t.shape != self.master.shape or t.dtype != self.states_dtype or t.device != self.master.device:
                raise ValueError(f"bound states must be flat {self.states_dtype} tensors of {self.master.numel()} "
                                 f"elements on {self.master.device}")
        if master is not None:
            if (master.shape, master.dtype, master.device) != (self.master.shape, torch.float32, self.master.device):
                raise ValueError(f"a bound master must be a flat fp32 tensor of {self.master.numel()} elements on "
                                 f"{self.master.device}")
            self.master = master
        self.exp_avg, self.exp_avg_sq = exp_avg, exp_avg_sq

    @property
    def block(self) -> int:
        """Elements per kernel call: a device streams whole chunks; a host works through cache-sized blocks of
        them, sized for the threads torch has now (the scratch caps it)."""
        if self.master.device.type != "cpu":
            return self.chunk
        return min(host_block(self.chunk), self.scratch.numel(), self._wide.shape[1])

    @property
    def step_count(self) -> int:
        return int(self.steps[0])

    def step(self, grad: torch.Tensor, lr: float, grad_scale: float = 1.0,
             before_chunk: Callable[[int], None] | None = None, part: str = "all",
             into: torch.Tensor | None = None) -> None:
        """One AdamW step from `grad` (flat, same length as the master), scaled first by `grad_scale`.

        `part`: "all"; or "params" then "moments", with the same gradient, scale and lr; or "speculate", which
        writes the new parameters `into` (flat, the master's length) and leaves the state as it was (see the
        module notes). A whole step may also write its new parameters `into` (rounded to its dtype: the copy a
        unit whose master is elsewhere loads from). `before_chunk(k)` runs before chunk k (`ranges[k]`) is read:
        e.g. to wait until it has arrived."""
        if part not in PARTS:
            raise ValueError(f"part must be one of {PARTS}, got {part!r}")
        if part != "all" and self.master.device.type != "cpu":
            raise ValueError("split and speculative steps run on host masters (a device unit steps whole)")
        if (part == "speculate" and into is None) or (into is not None and (
                part not in ("all", "speculate") or into.shape != self.master.shape)):
            raise ValueError("a speculative step writes `into`, a flat tensor of the master's length; a whole step "
                             "may, a split one may not")
        block = self.block
        speculate = part == "speculate"
        keep_params, keep_moments = part in ("all", "params"), part in ("all", "moments")
        for k, ((a, b), step) in enumerate(zip(self.ranges, self.steps)):
            if before_chunk is not None:
                before_chunk(k)
            if speculate:  # the update's number, counted in a copy
                step = step + 1
            elif keep_params:  # the "moments" part is the same update: it counts no step
                step += 1
            for start in range(a, b, block):
                end = min(start + block, b)
                n = end - start
                g = self.scratch[:n]
                g.copy_(grad[start:end])
                if grad_scale != 1.0:
                    g.mul_(grad_scale)
                m, v = self.exp_avg[start:end], self.exp_avg_sq[start:end]
                if self.narrow or not keep_moments:  # widened for the step (rounded back after), or dropped
                    m, v = self._wide[0, :n].copy_(m), self._wide[1, :n].copy_(v)
                p = self.master[start:end] if keep_params else self._wide[2, :n]
                if speculate:
                    p.copy_(self.master[start:end])
                _adamw_kernel(p, g, m, v, step, lr, self.config)
                if into is not None:
                    into[start:end].copy_(p)
                if self.narrow and keep_moments:
                    self.exp_avg[start:end].copy_(m)
                    self.exp_avg_sq[start:end].copy_(v)

    def state_tensors(self, to_host: bool = False) -> dict[str, torch.Tensor]:
        """Optimizer state as flat tensors, copied (empty before the first step)."""
        if not self.step_count:
            return {}
        device = torch.device("cpu") if to_host else self.master.device
        return {"step": self.steps[0].to(device, copy=True), "exp_avg": self.exp_avg.to(device, copy=True),
                "exp_avg_sq": self.exp_avg_sq.to(device, copy=True)}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load `state_tensors()` output (any states dtype: a bf16-states run may resume with fp32 ones)."""
        for key in ("exp_avg", "exp_avg_sq"):
            getattr(self, key).copy_(tensors[key] if tensors else 0)
        count = float(tensors["step"]) if tensors else 0.0  # one read, also of a device tensor
        for step in self.steps:
            step.fill_(count)


class StreamedStep:
    """Runs host units' AdamW steps on a device, piece by piece through a small device buffer.

    For each piece: master, m, v (and the gradient) are copied in (`load`), stepped by torch's AdamW on the
    device (`step`, which widens the gradient first: the same formula the host runs, so the two paths agree to
    the last bits on the same hardware) and copied back (`store`: master, m and v; or the master alone when the
    host steps the moments). Where each runs and what it waits for is the caller's business: the engine puts
    loads on its host-to-device stream, steps and stores on two streams of their own.
    """

    def __init__(self, numel: int, config: AdamWConfig, device: torch.device, grad_dtype: torch.dtype):
        if numel % PIECE_ALIGN:
            raise ValueError(f"a streamed piece must be a multiple of {PIECE_ALIGN} elements, got {numel}")
        self.numel = numel
        self.grad_in = torch.zeros(numel, dtype=grad_dtype, device=device)  # lands as it left the slot
        # STREAMED_FP32 fp32 buffers (streamed_step_bytes counts them)
        self.param = torch.zeros(numel, device=device)
        self.exp_avg = torch.zeros(numel, device=device)
        self.exp_avg_sq = torch.zeros(numel, device=device)
        self.grad = torch.zeros(numel, device=device)
        self.step_t = torch.zeros((), device=device)
        self.config = config

    def load(self, opt: FlatAdamW, start: int, end: int, grad: torch.Tensor) -> None:
        """Copy [start, end) of `opt`'s master and states in, and of `grad` unless it is on this device already
        (`end - start <= numel`): copies only, so a copy stream is never held up behind a kernel."""
        if opt.narrow:
            raise ValueError("streamed steps need fp32 AdamW states")
        n = end - start
        for dst, src in ((self.param, opt.master), (self.exp_avg, opt.exp_avg), (self.exp_avg_sq, opt.exp_avg_sq)):
            dst[:n].copy_(src[start:end], non_blocking=True)
        if grad.device != self.grad.device:  # lands as it is; `step` widens it, as the host path does
            self.grad_in[:n].copy_(grad[start:end], non_blocking=True)

    def step(self, start: int, end: int, grad: torch.Tensor, step_count: int, lr: float,
             grad_scale: float = 1.0) -> None:
        """AdamW on the piece `load(opt, start, end, grad)` landed, as update number `step_count + 1` of its
        chunk; the gradient is widened first (from where it landed, or from `grad` itself on this device)."""
        n = end - start
        grad_piece = self.grad[:n]
        grad_piece.copy_(grad[start:end] if grad.device == self.grad.device else self.grad_in[:n])
        if grad_scale != 1.0:
            grad_piece.mul_(grad_scale)
        self.step_t.fill_(step_count + 1)
        _adamw_kernel(self.param[:n], grad_piece, self.exp_avg[:n], self.exp_avg_sq[:n], self.step_t, lr,
                      self.config)

    def store(self, opt: FlatAdamW, start: int, end: int, moments: bool = True) -> None:
        """Copy the stepped master (and m and v, unless the host will step them: `FlatAdamW.step` part
        "moments") back to [start, end) of `opt`."""
        n = end - start
        pairs = ((opt.master, self.param), (opt.exp_avg, self.exp_avg), (opt.exp_avg_sq, self.exp_avg_sq))
        for dst, src in pairs if moments else pairs[:1]:
            dst[start:end].copy_(src[:n], non_blocking=True)


class HostAdamW:
    """AdamW over a list of flat fp32 host masters, one per unit, sharing one fp32 scratch.

    A unit given as None has no host optimizer (the engine updates it elsewhere, e.g. resident on the device);
    an `external` one keeps no m and v here (they are bound before each of its steps).
    """

    def __init__(self, masters: list[torch.Tensor | None], config: AdamWConfig,
                 states_dtype: torch.dtype = torch.float32, pinned: list[bool] | None = None,
                 bounds: list[tuple[int, ...]] | None = None, external: list[bool] | None = None):
        present = [m for m in masters if m is not None]
        for m in present:
            if m.dtype != torch.float32 or m.device.type != "cpu" or m.dim() != 1:
                raise ValueError("master weights must be flat fp32 tensors on the host")
        size = scratch_numel(max((m.numel() for m in present), default=1), True)
        scratch = torch.empty(size)  # one thread updates one unit at a time: every unit shares the scratch
        wide = torch.zeros(HOST_ROWS, size)
        self.masters = masters
        self.config = config
        pinned = pinned or [None] * len(masters)
        bounds = bounds or [()] * len(masters)
        external = external or [False] * len(masters)
        self.units = [None if m is None else FlatAdamW(m, config, scratch, states_dtype=states_dtype, wide=wide,
                                                       pinned_states=pin, bounds=cut, external_states=ext)
                      for m, pin, cut, ext in zip(masters, pinned, bounds, external)]

    def step_unit(self, unit: int, grad: torch.Tensor, lr: float, grad_scale: float = 1.0,
                  before_chunk: Callable[[int], None] | None = None, part: str = "all",
                  into: torch.Tensor | None = None) -> None:
        """Update one unit's master from its gradient (any dtype), scaled by `grad_scale` (e.g. clipping)."""
        self.units[unit].step(grad, lr, grad_scale, before_chunk, part, into)

    def state_tensors(self, unit: int) -> dict[str, torch.Tensor]:
        return self.units[unit].state_tensors()

    def load_state_tensors(self, unit: int, tensors: dict[str, torch.Tensor]) -> None:
        self.units[unit].load_state_tensors(tensors)
