"""The run's facts, decided once from its config before anything is placed: the tiers by name and the kind of memory
each is, the dtypes, and `RunFacts`, which the plan carries, the cost model prices and the engine runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

GPU, HOST, DISK = "gpu", "host", "disk"
TIERS = (GPU, HOST, DISK)  # the tiers every machine has
# Each tier by name and the kind of memory it is, which says how the engine reaches what it holds: "device" (the
# GPU's), "memory" (host memory: the optimizer steps states there in place) or "files" (read in ahead of each
# update and written back). A tier of another name (a second pool of host memory with a budget of its own, say)
# is one `register_tier` call: the placement counts and budgets it by its name, the engine reaches it as its kind.
TIER_KINDS: dict[str, str] = {GPU: "device", HOST: "memory", DISK: "files"}


def register_tier(name: str, kind: str) -> None:
    if kind not in ("device", "memory", "files"):
        raise ValueError(f"a tier is device, memory or files, got {kind!r}")
    TIER_KINDS[name] = kind


def kind_of(tier: str) -> str:
    return TIER_KINDS[tier]


ACTIVATION_TIERS = TIERS  # where boundary activations wait: the device, host memory, files
# The older words for those tiers, which a config may still give (`activation_tier` maps them, and only it)
OLD_ACTIVATION_WORDS = {"none": GPU, "cpu": HOST, "nvme": DISK}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # the one name -> dtype table
DTYPE_BYTES = {"fp32": 4, "bf16": 2}  # what a run computes in or keeps its AdamW moments in


@dataclass(frozen=True)
class RunFacts:
    """What the run is, decided once from its config: the plan carries it, the cost model prices it and the engine
    runs it. Nothing here is decided again at run time."""

    clip: float | None = 1.0  # the global gradient norm exact clipping keeps to; None: no clipping
    activations: str = HOST  # GPU | HOST | DISK: where boundary activations wait for the backward (auto: the plan's)
    compute_bytes: int = 2  # parameters, gradients and activations on the device: 2 (bf16) or 4 (fp32)
    state_bytes: int = 4  # per AdamW moment of a host unit: 4 (fp32) or 2 (bf16)
    device: str = "cuda"  # cpu | cuda | cuda:N
    ranks: int = 1  # data-parallel ranks (ranks.py): each keeps 1/ranks of every unit's host state
    # What the process holds in host memory besides the engine's buffers and the runtime, (name, bytes) each, as
    # the caller knows it (slide-train: the export's largest shard, converted while the engine still holds
    # everything): counted in the host tier with them, so that a plan fits its budget with it
    host_extras: tuple[tuple[str, int], ...] = ()

    def __post_init__(self):
        if self.activations not in (*ACTIVATION_TIERS, "auto"):
            old = (f" (the older word for {OLD_ACTIVATION_WORDS[self.activations]}: run_facts maps it)"
                   if self.activations in OLD_ACTIVATION_WORDS else "")
            raise ValueError(f"activations must be auto or one of {', '.join(ACTIVATION_TIERS)}, got "
                             f"{self.activations!r}{old}")
        if self.compute_bytes not in (2, 4) or self.state_bytes not in (2, 4):
            raise ValueError("compute and state bytes are 2 (bf16) or 4 (fp32), got "
                             f"{self.compute_bytes} and {self.state_bytes}")
        if self.clip is not None and not self.clip >= 0:
            raise ValueError(f"the clipping norm must be positive (or None for no clipping), got {self.clip}")
        if self.ranks < 1:
            raise ValueError(f"a run has at least one rank, got {self.ranks}")
        if any(not isinstance(name, str) or nbytes < 0 for name, nbytes in self.host_extras):
            raise ValueError(f"host extras are (name, bytes) pairs, got {self.host_extras!r}")
        torch.device(self.device)  # (a name torch does not know is refused here)

    @property
    def clips(self) -> bool:
        return bool(self.clip)

    @property
    def cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float32 if self.compute_bytes == 4 else torch.bfloat16

    @property
    def states_dtype(self) -> torch.dtype:
        return torch.float32 if self.state_bytes == 4 else torch.bfloat16


def resolve_device(name: str = "auto") -> str:
    """A device name as the run uses it: `auto` is CUDA where there is a device, else the CPU. CUDA asked for
    where there is none is refused."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(name).type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"the device is {name!r} but no CUDA device is available here; use cpu")
    return name


def activation_tier(word: str) -> str:
    """The boundary activations' tier a config's word names: GPU, HOST, DISK and auto name themselves, and the
    older words none (the device), cpu (host memory) and nvme (files) their tiers."""
    return OLD_ACTIVATION_WORDS.get(word, word)


def run_facts(*, device: str = "auto", compute_dtype: str = "auto", states_dtype: str = "fp32",
              max_grad_norm: float | None = 1.0, activation_offload: str = HOST, ranks: int = 1,
              here: bool = True) -> RunFacts:
    """A run's facts from its config's words: `auto` compute is bf16 on CUDA and fp32 on a CPU. `here`: the
    device is this machine's (resolved, refused where absent); otherwise a name for planning elsewhere.
    `activation_offload` is a tier (or auto), or an older word for one (`activation_tier`)."""
    device = resolve_device(device) if here else ("cuda" if device == "auto" else device)
    cuda = torch.device(device).type == "cuda"
    if compute_dtype not in ("auto", *DTYPE_BYTES):
        raise ValueError(f"compute_dtype must be auto, fp32 or bf16, got {compute_dtype!r}")
    if states_dtype not in DTYPE_BYTES:
        raise ValueError(f"states_dtype must be fp32 or bf16, got {states_dtype!r}")
    compute = 2 if compute_dtype == "bf16" or (compute_dtype == "auto" and cuda) else 4
    return RunFacts(clip=max_grad_norm or None, activations=activation_tier(activation_offload), compute_bytes=compute,
                    state_bytes=DTYPE_BYTES[states_dtype], device=device, ranks=ranks)
