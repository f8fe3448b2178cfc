"""Random initial weights for built-in presets, produced tensor by tensor (a 8B preset never exists twice in host
memory). Each tensor has its own generator seeded from (seed, name), so results do not depend on load order."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch
import transformers

from ..errors import ModelError
from .families import FAMILIES


class RandomWeights:
    """HF-style init: normal(0, initializer_range) for matrices and embeddings, the family's neutral weight for
    norms (ones; zeros for Gemma's 1 + weight), zeros for biases."""

    def __init__(self, config: transformers.PretrainedConfig, seed: int):
        with torch.device("meta"):
            skeleton = transformers.AutoModelForCausalLM.from_config(config)
        self.shapes = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
        self.std = getattr(config, "initializer_range", 0.02)
        self.seed = seed
        family = FAMILIES.get(config.model_type)
        self.norm_value = family.norm_init if family is not None else 1.0

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def keys(self) -> Iterator[str]:
        return iter(self.shapes)

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Fill `out` (the tensor's shape) with the initial values, drawn in place: an 8B preset's init is one
        pass over its masters (drawing, scaling and copying took three)."""
        if name not in self.shapes:
            raise ModelError(f"tensor {name!r} is not part of this model")
        if tuple(out.shape) != self.shapes[name]:
            raise ModelError(f"{name} has shape {self.shapes[name]} in this config, not {tuple(out.shape)}")
        if name.endswith("norm.weight"):
            out.fill_(self.norm_value)
        elif name.endswith(".bias"):
            out.zero_()
        else:
            digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
            out.normal_(0.0, self.std, generator=gen)
