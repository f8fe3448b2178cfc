"""Reading HF weights tensor by tensor from safetensors files (sharded or not), never the whole model at once.

Only safetensors are read: pickle-based `*.bin` checkpoints can run arbitrary code when loaded, so they are
refused with a hint to convert them.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open

from ..errors import ModelError


class SafetensorsWeights:
    """name -> tensor over the `*.safetensors` files of a local HF model directory."""

    def __init__(self, directory: str | pathlib.Path):
        self.dir = pathlib.Path(directory)
        self._handles: dict[pathlib.Path, object] = {}
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ModelError(f"{index} is not a valid safetensors index ({e})") from e
            self.files = {name: self.dir / file for name, file in weight_map.items()}
        else:
            shards = sorted(self.dir.glob("*.safetensors"))
            if not shards:
                pickled = sorted(p.name for p in self.dir.glob("*.bin"))
                hint = (f" It has {', '.join(pickled)}: pickle checkpoints are not loaded because they can run"
                        " code; convert them to safetensors first." if pickled else "")
                raise ModelError(f"no *.safetensors weights in {self.dir}.{hint}")
            self.files = {}
            for shard in shards:
                for name in self._open(shard).keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    self.files[name] = shard

    def _open(self, path: pathlib.Path):
        if path not in self._handles:
            if not path.is_file():
                raise ModelError(f"weight file {path} is listed in the index but missing")
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as e:
                raise ModelError(f"cannot read weights {path}: {e} (the file may be truncated or corrupt)") from e
        return self._handles[path]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def keys(self) -> Iterator[str]:
        return iter(self.files)

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Copy tensor `name` into `out` (converting its dtype), which must have its shape."""
        if name not in self.files:
            raise ModelError(f"tensor {name!r} is missing from the weights in {self.dir}")
        path = self.files[name]
        try:
            tensor = self._open(path).get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ModelError(f"cannot read {name!r} from {path}: {e} (truncated or corrupt file?)") from e
        if tuple(tensor.shape) != tuple(out.shape):
            raise ModelError(f"{name} has shape {tuple(tensor.shape)} in the weights, the config implies "
                             f"{tuple(out.shape)}: do config.json and the safetensors files belong together?")
        out.copy_(tensor)
