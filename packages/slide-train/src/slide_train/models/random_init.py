"""Random initial weights for built-in presets, produced tensor by tensor (a 8B preset never exists twice in host
memory). Each tensor has its own generator seeded from (seed, name), so results do not depend on load order."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch
import transformers

from ..errors import ModelError


class RandomWeights:
    """HF-style init: normal(0, initializer_range) for matrices and embeddings, ones for norms, zeros for biases."""

    def __init__(self, config: transformers.PretrainedConfig, seed: int):
        with torch.device("meta"):
            skeleton = transformers.AutoModelForCausalLM.from_config(config)
        self.shapes = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
        self.std = getattr(config, "initializer_range", 0.02)
        self.seed = seed

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def keys(self) -> Iterator[str]:
        return iter(self.shapes)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise ModelError(f"tensor {name!r} is not part of this model")
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        if name.endswith(".bias"):
            return torch.zeros(shape)
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        return torch.randn(shape, generator=gen) * self.std
