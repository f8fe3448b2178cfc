"""AdamW over one flat fp32 master tensor (a unit: a block, or the edges), on the host or on the device.

Each unit's update runs on its own so the engine can overlap it with device work on other units. The math is
torch's own AdamW (the fused kernel where the device has one), so results match a plain `torch.optim.AdamW`
loop. Gradients arrive in the compute dtype (bf16) and are widened chunk by chunk into a small fp32 scratch, so
no full-size fp32 gradient ever exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK = 1 << 25  # elements per update chunk: 128 MiB of fp32 scratch


@dataclass
class AdamWConfig:
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0


def _fused_supported(device: torch.device) -> bool:
    try:
        p = torch.zeros(1, device=device)
        p.grad = torch.zeros(1, device=device)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except (RuntimeError, TypeError):
        return False


class FlatAdamW:
    """AdamW over one flat fp32 master; `step` takes the unit's gradient in any dtype.

    `states_dtype=torch.bfloat16` stores m and v in bf16 (half their memory); each chunk is widened to fp32 for
    the step and rounded back, so the arithmetic stays fp32 and only the stored states lose precision.
    """

    def __init__(self, master: torch.Tensor, config: AdamWConfig, scratch: torch.Tensor | None = None,
                 chunk: int = CHUNK, states_dtype: torch.dtype = torch.float32, wide: torch.Tensor | None = None):
        if master.dtype != torch.float32 or master.dim() != 1:
            raise ValueError("master weights must be a flat fp32 tensor")
        self.master, self.config = master, config
        # Views of the master are leaves (it does not require grad), so each chunk is its own AdamW parameter.
        self.chunks = [master[i : i + chunk] for i in range(0, master.numel(), chunk)] or [master]
        kind = {"fused": True} if _fused_supported(master.device) else {"foreach": False}
        self._opts = [torch.optim.AdamW([c], lr=config.lr, betas=config.betas, eps=config.eps,
                                        weight_decay=config.weight_decay, **kind) for c in self.chunks]
        size = min(chunk, master.numel())
        self.scratch = scratch if scratch is not None else torch.empty(size, device=master.device)
        self.states_dtype = states_dtype
        self.narrow = states_dtype != torch.float32
        if self.narrow:  # stored states, and fp32 room to run one chunk's step in
            self.exp_avg = torch.zeros(master.numel(), dtype=states_dtype, device=master.device)
            self.exp_avg_sq = torch.zeros_like(self.exp_avg)
            self._wide = wide if wide is not None else torch.empty(2, size, device=master.device)
            for param, opt in zip(self.chunks, self._opts):
                opt.state[param] = {"step": torch.zeros((), dtype=torch.float32, device=master.device)}

    def step(self, grad: torch.Tensor, lr: float, grad_scale: float = 1.0) -> None:
        """One AdamW step from `grad` (flat, same length as the master), scaled first by `grad_scale`."""
        offset = 0
        for param, opt in zip(self.chunks, self._opts):
            n = param.numel()
            g = self.scratch[:n]
            g.copy_(grad[offset : offset + n])
            if grad_scale != 1.0:
                g.mul_(grad_scale)
            if self.narrow:
                state = opt.state[param]
                state["exp_avg"], state["exp_avg_sq"] = self._wide[0, :n], self._wide[1, :n]
                state["exp_avg"].copy_(self.exp_avg[offset : offset + n])
                state["exp_avg_sq"].copy_(self.exp_avg_sq[offset : offset + n])
            param.grad = g
            opt.param_groups[0]["lr"] = lr
            opt.step()
            param.grad = None
            if self.narrow:
                self.exp_avg[offset : offset + n].copy_(state["exp_avg"])
                self.exp_avg_sq[offset : offset + n].copy_(state["exp_avg_sq"])
            offset += n

    def state_tensors(self, to_host: bool = False) -> dict[str, torch.Tensor]:
        """Optimizer state as flat tensors (empty before the first step); copies, chunk by chunk, so a device
        state is never doubled on the device."""
        states = [opt.state.get(p, {}) for p, opt in zip(self.chunks, self._opts)]
        if not states[0] or not float(states[0]["step"]):
            return {}
        device = torch.device("cpu") if to_host else self.master.device
        out = {"step": states[0]["step"].to(device, copy=True)}
        for key in ("exp_avg", "exp_avg_sq"):
            if self.narrow:
                out[key] = getattr(self, key).to(device, copy=True)
                continue
            flat = torch.empty(self.master.numel(), dtype=torch.float32, device=device)
            offset = 0
            for state in states:
                n = state[key].numel()
                flat[offset : offset + n].copy_(state[key])
                offset += n
            out[key] = flat
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.narrow:
            self.exp_avg.copy_(tensors["exp_avg"] if tensors else 0)
            self.exp_avg_sq.copy_(tensors["exp_avg_sq"] if tensors else 0)
            for param, opt in zip(self.chunks, self._opts):
                step = tensors["step"] if tensors else torch.zeros(())
                opt.state[param]["step"] = step.to(param.device, torch.float32, copy=True)
            return
        offset = 0
        for param, opt in zip(self.chunks, self._opts):
            n = param.numel()
            if not tensors:
                opt.state.pop(param, None)
                continue
            state = opt.state.setdefault(param, {})
            # fp32 whatever the checkpoint holds (a run saved with bf16 states may resume with fp32 ones)
            state["exp_avg"] = tensors["exp_avg"][offset : offset + n].to(param.device, torch.float32, copy=True)
            state["exp_avg_sq"] = tensors["exp_avg_sq"][offset : offset + n].to(param.device, torch.float32,
                                                                                  copy=True)
            state["step"] = tensors["step"].to(param.device, copy=True)
            offset += n


class HostAdamW:
    """AdamW over a list of flat fp32 host masters, one per unit, sharing one fp32 scratch."""

    def __init__(self, masters: list[torch.Tensor], config: AdamWConfig, states_dtype: torch.dtype = torch.float32):
        for m in masters:
            if m.dtype != torch.float32 or m.device.type != "cpu" or m.dim() != 1:
                raise ValueError("master weights must be flat fp32 tensors on the host")
        size = min(CHUNK, max(m.numel() for m in masters))
        scratch = torch.empty(size)  # one thread updates one unit at a time: every unit shares the scratch
        wide = torch.empty(2, size) if states_dtype != torch.float32 else None
        self.masters = masters
        self.config = config
        self.units = [FlatAdamW(m, config, scratch, states_dtype=states_dtype, wide=wide) for m in masters]

    def step_unit(self, unit: int, grad: torch.Tensor, lr: float, grad_scale: float = 1.0) -> None:
        """Update one unit's master from its gradient (any dtype), scaled by `grad_scale` (e.g. clipping)."""
        self.units[unit].step(grad, lr, grad_scale)

    def state_tensors(self, unit: int) -> dict[str, torch.Tensor]:
        return self.units[unit].state_tensors()

    def load_state_tensors(self, unit: int, tensors: dict[str, torch.Tensor]) -> None:
        self.units[unit].load_state_tensors(tensors)
