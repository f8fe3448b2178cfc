"""AdamW on the host over flat fp32 master weights, one unit (block, or the edge unit) at a time.

Each unit's update runs on its own so the engine can overlap it with device work on other units. The math is
torch's own AdamW (fused CPU kernel where available), so results match a plain `torch.optim.AdamW` loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AdamWConfig:
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0


def _fused_cpu_supported() -> bool:
    try:
        p = torch.zeros(1, requires_grad=False)
        p.grad = torch.zeros(1)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except (RuntimeError, TypeError):
        return False


class HostAdamW:
    """AdamW over a list of flat fp32 master tensors (one per unit)."""

    def __init__(self, masters: list[torch.Tensor], config: AdamWConfig):
        for m in masters:
            if m.dtype != torch.float32 or m.device.type != "cpu" or m.dim() != 1:
                raise ValueError("master weights must be flat fp32 tensors on the host")
        self.masters = masters
        self.config = config
        fused = _fused_cpu_supported()
        # torch's fused CPU kernel when this build has it, else the single-tensor loop (one flat tensor per unit
        # leaves nothing for foreach to batch).
        kind = {"fused": True} if fused else {"foreach": False}
        self._opts = [
            torch.optim.AdamW([m], lr=config.lr, betas=config.betas, eps=config.eps,
                              weight_decay=config.weight_decay, **kind)
            for m in masters
        ]

    def step_unit(self, unit: int, grad: torch.Tensor, lr: float, grad_scale: float = 1.0) -> None:
        """Update one unit's master from its fp32 gradient (scaled in place by `grad_scale`, e.g. clipping)."""
        if grad_scale != 1.0:
            grad.mul_(grad_scale)
        master, opt = self.masters[unit], self._opts[unit]
        master.grad = grad
        opt.param_groups[0]["lr"] = lr
        opt.step()
        master.grad = None

    def state_tensors(self, unit: int) -> dict[str, torch.Tensor]:
        """The unit's optimizer state as plain tensors (for safetensors checkpoints); empty before step 1."""
        state = self._opts[unit].state.get(self.masters[unit], {})
        return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}

    def load_state_tensors(self, unit: int, tensors: dict[str, torch.Tensor]) -> None:
        master = self.masters[unit]
        if not tensors:
            self._opts[unit].state.pop(master, None)
            return
        state = self._opts[unit].state.setdefault(master, {})
        for k, v in tensors.items():
            state[k] = v.clone()
