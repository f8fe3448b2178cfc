"""Attention backends: the kernels a layer kind's attention can run through, each saying which layers it computes
exactly, on which devices, and preparing what its calls need (a dense mask, a block mask, document boundaries).

A layer kind declares what its attention needs (`Needs`); `candidates` lists the backends that compute it exactly
here, fastest kind first, and the plan chooses one per layer kind among them by the rates the machine file holds.
The head prepares each kind's context once per micro-batch (`Prepared`, handed to the layers as their attention
mask) and `attention.attend` runs the backend it names.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.nn.attention.flex_attention import flex_attention
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import attention as masks

__all__ = ["BACKENDS", "Backend", "CompiledFlex", "Needs", "Prepared", "candidates", "get", "layer_needs", "prepare",
           "reasons"]


@dataclass(frozen=True)
class Needs:
    """What one layer kind's causal attention must compute over the run's rows."""

    head_dim: int
    window: int | None = None  # a sliding window shorter than the rows (None: the whole causal row)
    softcap: float | None = None  # the attention logits' soft-cap (Gemma 2)
    documents: bool = False  # packed rows: a query sees only its own document
    tile: int = 0  # queries per tile where the block runs its attention by query tiles (0: whole rows)


@dataclass(frozen=True)
class Prepared:
    """One layer kind's attention for one micro-batch, handed to its layers as their attention mask: the backend
    that runs it, what that backend prepared, the window it applies (None: none shorter than the rows) and whether
    the rows hold documents."""

    backend: Backend
    context: object
    window: int | None
    documents: bool
    # its tiles' own (`Backend.tile`), by (start, end): made once, shared by every layer and the recompute
    tiles: dict = field(default_factory=dict, repr=False, compare=False)


class Backend:
    """A way to run a layer's attention. `why_not(needs, device, dtype)`: None where it computes `needs` exactly
    there, else the reason; `prepare(...)`: its context for a micro-batch; `tile(...)`: the context of a tile of
    queries [start, end) against keys [0, end) (where `why_not` allows `needs.tile`); `attend(...)`:
    transformers' attention function signature, returning (out [B, S, H, D], None)."""

    name = ""

    def why_not(self, needs: Needs, device: torch.device, dtype: torch.dtype) -> str | None:
        raise NotImplementedError

    def prepare(self, documents: torch.Tensor | None, window: int | None, seq: int, dtype, device) -> object:
        return None

    def tile_context(self, context: object, start: int, end: int, device) -> object:
        raise NotImplementedError(f"attention backend {self.name} runs no query tiles")

    def tile(self, prepared: Prepared, start: int, end: int, device) -> Prepared:
        """`prepared` for the queries [start, end) of its rows, against the keys [0, end): made once per micro-batch
        and tile, then shared by every layer and by the backward's recompute."""
        if (start, end) not in prepared.tiles:
            prepared.tiles[start, end] = Prepared(self, self.tile_context(prepared.context, start, end, device),
                                                  prepared.window, prepared.documents)
        return prepared.tiles[start, end]

    def attend(self, module, query, key, value, prepared: Prepared, scaling, softcap, **kwargs):
        raise NotImplementedError


def prepare(backend: Backend, documents: torch.Tensor | None, window: int | None, seq: int, dtype,
            device) -> Prepared:
    """`backend`'s attention for a micro-batch of rows of `seq` tokens (`documents`: their document ids, or None)."""
    window = window if window is not None and window < seq else None
    return Prepared(backend, backend.prepare(documents, window, seq, dtype, device), window, documents is not None)


def _quadratic(device: torch.device) -> str | None:
    return None if device.type == "cpu" else "it builds the whole [S, S] mask, which only the CPU path allows"


class Sdpa(Backend):
    """torch's scaled_dot_product_attention (flash or cuDNN kernels on CUDA): plain causal attention on CUDA;
    with a dense boolean mask (windows, documents) on the CPU. No soft-cap."""

    name = "sdpa"

    def why_not(self, needs, device, dtype):
        if needs.softcap is not None:
            return "it has no soft-cap"
        if needs.window is not None or needs.documents:
            return _quadratic(device)
        if needs.tile and device.type != "cpu":
            return "its CUDA kernels align the causal mask at the top left (is_causal), not at a query tile's offset"
        return None

    def prepare(self, documents, window, seq, dtype, device):
        mask = masks.attention_mask(documents, window, seq, device)
        if mask is not None and device.type != "cpu":
            raise ValueError("attention backend sdpa was planned for plain causal layers, but this micro-batch "
                             "has documents or a window shorter than its rows: plan the run with them")
        return mask

    def tile_context(self, context, start, end, device):
        return masks.tile_of(context, start, end, device)

    def attend(self, module, query, key, value, prepared, scaling, softcap, **kwargs):
        return sdpa_attention_forward(module, query, key, value, prepared.context, scaling=scaling, **kwargs)


class Eager(Backend):
    """HF's eager attention of the layer's own family (it adds a float mask): anything, on the CPU."""

    name = "eager"

    def why_not(self, needs, device, dtype):
        return _quadratic(device)

    def prepare(self, documents, window, seq, dtype, device):
        return masks.additive_mask(masks.attention_mask(documents, window, seq, device), seq, dtype, device)

    def tile_context(self, context, start, end, device):
        return context[:, :, start:end, :end]

    def attend(self, module, query, key, value, prepared, scaling, softcap, **kwargs):
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, value, prepared.context, scaling=scaling, softcap=softcap, **kwargs)


class CompiledFlex:
    """FlexAttention compiled once per use (layer rule and grad mode), lengths dynamic after the first: each use
    is a function with a code object of its own, so no use's recompiles count against another's limit, and a
    compile past the limit raises rather than running the eager kernel, which materializes the [S, S] scores.

    `kernel` and `backend` are torch.compile's function and backend (a test counts compiles through them)."""

    def __init__(self, kernel: Callable = flex_attention, backend: str | Callable = "inductor"):
        self.kernel, self.backend = kernel, backend
        self.entries: dict[tuple, Callable] = {}

    def _entry(self, use: tuple) -> Callable:
        kernel = self.kernel

        def call(query, key, value, score_mod, block_mask, scale, enable_gqa):
            return kernel(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
                          enable_gqa=enable_gqa)

        call.__code__ = call.__code__.replace(co_name=f"flex_attention_{len(self.entries)}")
        return torch.compile(call, backend=self.backend, dynamic=None)

    def __call__(self, use: tuple, query, key, value, score_mod, block_mask, scale, enable_gqa):
        use = (*use, torch.is_grad_enabled())
        entry = self.entries.get(use)
        if entry is None:
            entry = self.entries[use] = self._entry(use)
        try:
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
                return entry(query, key, value, score_mod, block_mask, scale, enable_gqa)
        except torch._dynamo.exc.FailOnRecompileLimitHit as e:
            raise RuntimeError(
                f"FlexAttention recompiled past torch._dynamo's limit ({torch._dynamo.config.recompile_limit}) for "
                f"one use {use}: its eager kernel would materialize the whole score matrix, so the step stops "
                "here. Raise torch._dynamo.config.recompile_limit, or keep the rows' lengths to a few values") from e


@functools.cache
def _soft_cap(softcap: float):
    """Soft-capping as a score rule, one function per cap (the compiled kernel sees the same rule every call)."""
    def score_mod(score, b, h, q, kv):
        return softcap * torch.tanh(score / softcap)
    return score_mod


class Flex(Backend):
    """FlexAttention through its compiled Triton kernel: anything, on CUDA, with no [S, S] buffer."""

    name = "flex"

    def __init__(self):
        self.compiled = CompiledFlex()

    def why_not(self, needs, device, dtype):
        if device.type != "cuda":
            return "its fused kernel runs on CUDA only"
        if needs.tile % masks.TILE:
            return f"query tiles of {needs.tile} positions (its block masks take multiples of {masks.TILE})"
        return None

    def prepare(self, documents, window, seq, dtype, device):
        return masks.row_mask(documents, window, seq, device)

    def tile_context(self, context, start, end, device):
        return dataclasses.replace(context, block=masks.tile_block_mask(context, start, end))

    def attend(self, module, query, key, value, prepared, scaling, softcap, **kwargs):
        score_mod = _soft_cap(softcap) if softcap is not None else None
        # (tiles compile apart from whole rows: their lengths vary tile by tile)
        use = (prepared.window, prepared.documents, softcap, query.shape[2] != key.shape[2])
        out = self.compiled(use, query, key, value, score_mod, prepared.context.block, scaling,
                            query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous(), None


FA4_MODULE = "flash_attn.cute"  # flash-attn-4's CuTe DSL kernels (the `flash-attn-4` package)


class FlashAttn4(Backend):
    """flash-attn-4 on Hopper and newer: causal, windows, soft-cap, grouped heads, head_dim up to 256, and packed
    documents through its variable-length entry point. An optional extra (`slide-train[fa4]`)."""

    name = "fa4"

    def why_not(self, needs, device, dtype):
        if device.type != "cuda":
            return "it runs on CUDA only"
        if importlib.util.find_spec(FA4_MODULE.split(".")[0]) is None or _fa4() is None:
            return "flash-attn-4 is not installed (pip install 'slide-train[fa4]')"
        if torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] < 9:  # (a plan on paper: as given)
            return "it needs a Hopper or newer GPU (its soft-cap backward refuses SM8x)"
        if dtype not in (torch.bfloat16, torch.float16):
            return f"it computes in bf16 or fp16, not {dtype}"
        if needs.head_dim > 256 or needs.head_dim % 8:
            return f"head_dim {needs.head_dim} (it takes multiples of 8 up to 256)"
        if needs.tile and needs.documents:
            return "packed documents in query tiles need each tile's variable-length boundaries, not built"
        return None

    def prepare(self, documents, window, seq, dtype, device):
        if documents is None:
            return None
        return _boundaries(documents)

    def tile_context(self, context, start, end, device):
        return None  # (its causal mask and window are aligned at the bottom right: the tile's queries are last)

    def attend(self, module, query, key, value, prepared, scaling, softcap, **kwargs):
        fa4 = _fa4()
        left = prepared.window - 1 if prepared.window is not None else None  # HF's window: q - kv < it
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, S, H, D]: transformers' layout, made free
        cap = float(softcap) if softcap is not None else 0.0
        if prepared.context is None:
            out = fa4.flash_attn_func(q, k, v, softmax_scale=scaling, causal=True, window_size=(left, 0),
                                      softcap=cap)[0]
        else:
            cu, longest = prepared.context
            b, s = q.shape[:2]
            out = fa4.flash_attn_varlen_func(
                q.reshape(b * s, *q.shape[2:]), k.reshape(b * s, *k.shape[2:]), v.reshape(b * s, *v.shape[2:]),
                cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest, softmax_scale=scaling,
                causal=True, window_size=(left, 0), softcap=cap)[0].view(b, s, *q.shape[2:])
        return out, None


@functools.cache
def _fa4():
    try:
        return importlib.import_module(FA4_MODULE)
    except Exception:  # installed but unusable (its CUDA libraries): not a candidate
        return None


def _boundaries(documents: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Packed rows as variable-length sequences: (cumulative starts over the flattened rows, int32; the longest).
    A document ends where its id changes or a row ends; each padding position (id < 0) is a sequence of its own,
    so it sees only itself, as in the block mask. One host sync: the kernel needs the count and the longest."""
    b, s = documents.shape
    ids = torch.where(documents >= 0, documents.long(), -1 - torch.arange(s, device=documents.device))
    start = torch.ones_like(ids, dtype=torch.bool)
    start[:, 1:] = ids[:, 1:] != ids[:, :-1]
    starts = start.reshape(-1).nonzero().squeeze(1)
    cu = torch.cat([starts, starts.new_tensor([b * s])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


BACKENDS: dict[str, Backend] = {b.name: b for b in (Sdpa(), FlashAttn4(), Flex(), Eager())}


def layer_needs(windows: dict[str, int | None], head_dim: int, softcap: float | None, seq: int,
                documents: bool, tile: int = 0) -> dict[str, Needs]:
    """Each layer type's needs over rows of `seq` tokens, from its window (None: full attention); a window no
    shorter than the rows is plain causal attention. `tile`: the queries per tile where the blocks run their
    attention by query tiles (rows no longer than a tile run whole)."""
    tile = tile if 0 < tile < seq else 0
    return {kind: Needs(head_dim, window if window is not None and window < seq else None, softcap, documents, tile)
            for kind, window in windows.items()}


def get(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}: one of {', '.join(BACKENDS)}")
    return BACKENDS[name]


def candidates(needs: Needs, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """The backends that compute `needs` exactly on `device`, in BACKENDS' order (fused before dense)."""
    return tuple(name for name, b in BACKENDS.items() if b.why_not(needs, torch.device(device), dtype) is None)


def reasons(needs: Needs, device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """Why each backend that cannot compute `needs` on `device` cannot (for messages)."""
    out = {name: b.why_not(needs, torch.device(device), dtype) for name, b in BACKENDS.items()}
    return {name: why for name, why in out.items() if why is not None}
