"""Attention by query tiles inside a block: in float64 a block whose attention half and MLP run over tiles gives the
untiled block's outputs and every gradient (Llama, Mistral with a window, Qwen2, Qwen3's q/k norms, Gemma 2's
soft-cap and window, OLMo 2's norms after attention, OLMoE's mixture), with packed documents and windows at an
offset; rows of one tile run the modules bit for bit; what the tiled block keeps for its backward stays within the
placement's workspace; a tile's block mask is the dense mask's rows."""

from __future__ import annotations

import weakref

import pytest
import torch
from conftest import tiny_config, whole_and_tiled

from slide_scheduler import Shapes, StepShape, block_workspace
from slide_train.models import attention, backends

# Families and what their tiny configs change: a window shorter than the rows where the family slides one
FAMILY_CHANGES = {
    "llama": {},
    "mistral": {"sliding_window": 7},
    "qwen2": {},
    "qwen3": {},
    "gemma2": {},  # (tiny_config: a window of 6, attention soft-capping: HF's eager attention)
    "olmo2": {},
    "olmoe": {},
}
# HF's Gemma norms scale by (1 + weight.float()): their weights' gradients are fp32 sums over the tokens
FP32_SUMS = {"gemma2"}
TILE, SEQ = 5, 13  # rows of three tiles, the last one short


def _blocks(model_type: str, changes: dict, tile: int, layer: int = 0):
    """Layer `layer`'s block whole and tiled by query tiles of `tile`, with the same float64 parameters, the stack
    and edges."""
    def config_of():
        config = tiny_config(model_type)
        for key, value in changes.items():
            setattr(config, key, value)
        return config

    return whole_and_tiled(config_of, tile, queries=True, shape_of=lambda stack: stack.block_shape(layer))


def _documents(seq: int) -> torch.Tensor:
    """Two rows of packed documents, cut across tiles, the second ending in padding."""
    first = [0] * 3 + [1] * 6 + [2] * (seq - 9)
    second = [4] * 8 + [5] * (seq - 10) + [-1] * 2
    return torch.tensor([first, second])


def _run(block, edges, stack, seq: int, layer: int = 0, documents: torch.Tensor | None = None):
    """Outputs, input gradient and parameter gradients of one forward and backward of `block` (float64)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 200, (2, seq), generator=g)
    batch = {"input_ids": ids, "position_ids": torch.arange(seq).expand(2, seq)}
    if documents is not None:  # (positions restart in each document, as packing lays them)
        starts = torch.ones_like(documents, dtype=torch.bool)
        starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
        index = torch.arange(seq).expand(2, seq)
        batch["position_ids"] = index - torch.cummax(torch.where(starts, index, 0), dim=1).values
        batch["document_ids"] = documents
    with torch.no_grad():
        _, ctx = edges.head(batch)
    x = torch.randn(2, seq, stack.config.hidden_size, generator=g, dtype=torch.float64, requires_grad=True)
    out = block(x, stack.block_context(layer, ctx))
    out.backward(torch.randn(out.shape, generator=g, dtype=torch.float64))
    return out.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}


def _assert_same(model_type: str, a, b, rtol: float = 1e-10) -> None:
    scale = a[0].abs().max().item()
    torch.testing.assert_close(b[0], a[0], rtol=rtol, atol=rtol * scale)
    torch.testing.assert_close(b[1], a[1], rtol=rtol, atol=rtol * a[1].abs().max().item())
    for name, grad in a[2].items():
        fp32 = model_type in FP32_SUMS and name.endswith("norm.weight")
        tol = (1e-6 if fp32 else rtol) * grad.abs().max().item()
        torch.testing.assert_close(b[2][name], grad, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("model_type", list(FAMILY_CHANGES))
def test_a_block_tiled_by_queries_gives_the_whole_rows_outputs_and_gradients(model_type):
    """Rows of 13 positions in tiles of 5: the outputs and the gradients of the input and every parameter equal
    the untiled block's to 1e-10 relative (float64), the attention half really runs tile by tile (three calls of
    the attention function per pass, queries of 5, 5 and 3 against 5, 10 and 13 keys), and rows of one tile give
    the untiled block's bits."""
    changes = FAMILY_CHANGES[model_type]
    layer = 0
    (whole, tiled), stack, edges = _blocks(model_type, changes, TILE, layer)
    calls = []
    original = backends.Backend.tile

    def counted(self, prepared, start, end, device):
        calls.append((start, end))
        return original(self, prepared, start, end, device)

    backends.Backend.tile = counted
    try:
        a, b = _run(whole, edges, stack, SEQ, layer), _run(tiled, edges, stack, SEQ, layer)
    finally:
        backends.Backend.tile = original
    assert calls == [(0, 5), (5, 10), (10, 13), (10, 13), (5, 10), (0, 5)]  # forward in order, backward last first
    _assert_same(model_type, a, b)
    for p in (*whole.parameters(), *tiled.parameters()):
        p.grad = None
    a, b = _run(whole, edges, stack, TILE, layer), _run(tiled, edges, stack, TILE, layer)
    assert b[0].equal(a[0]) and b[1].equal(a[1])
    assert all(b[2][name].equal(grad) for name, grad in a[2].items())


@pytest.mark.parametrize("model_type, changes", [("llama", {}), ("mistral", {"sliding_window": 4}),
                                                 ("gemma2", {})])
def test_packed_documents_and_windows_at_an_offset(model_type, changes):
    """Packed documents cut across tiles (and padding), with no window, a window of 4 (Mistral: SDPA's dense
    mask) and Gemma 2's window of 6 (eager attention): the tiled block equals the untiled one to 1e-10."""
    (whole, tiled), stack, edges = _blocks(model_type, changes, TILE)
    docs = _documents(SEQ)
    a, b = _run(whole, edges, stack, SEQ, documents=docs), _run(tiled, edges, stack, SEQ, documents=docs)
    _assert_same(model_type, a, b)


def test_a_tiles_block_mask_is_the_dense_masks_rows():
    """FlexAttention's block mask of a tile (queries [256, 384) and [384, 400) of 400, documents and a window)
    allows exactly the dense mask's rows of those queries against the keys up to the tile's end."""
    seq, window = 400, 150
    docs = torch.tensor([[0] * 100 + [1] * 200 + [2] * 90 + [-1] * 10])
    rows = attention.row_mask(docs, window, seq, "cpu")
    dense = attention.attention_mask(docs, window, seq, "cpu")
    for start, end in ((256, 384), (384, 400), (0, 128)):
        mask = attention.tile_block_mask(rows, start, end)
        assert mask.seq_lengths == (end - start, end)
        shown = mask.to_dense().repeat_interleave(attention.TILE, -2).repeat_interleave(attention.TILE, -1)
        q, kv = torch.arange(end - start)[:, None], torch.arange(end)[None, :]
        allowed = torch.stack([mask.mask_mod(torch.tensor(0), torch.tensor(0), q, kv)])[:, None]
        allowed = allowed & shown[..., :end - start, :end].bool()
        assert allowed.equal(dense[:, :, start:end, :end])
    with pytest.raises(ValueError, match="multiple of 128"):
        attention.tile_block_mask(rows, 100, 228)


class _LiveSaved:
    """Saved-tensor hooks that count the bytes autograd holds for backward at any time (each storage once, the
    parameters and the block's input left out) and their peak."""

    def __init__(self, skip: set[int]):
        self.skip, self.live, self.peak = skip, {}, 0

    def pack(self, t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if key in self.skip:
            return t
        holder = _Held(t)
        nbytes, count = self.live.get(key, (t.untyped_storage().nbytes(), 0))
        self.live[key] = (nbytes, count + 1)
        weakref.finalize(holder, self._released, key)
        self.peak = max(self.peak, sum(n for n, _ in self.live.values()))
        return holder

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def _released(self, key: int) -> None:
        nbytes, count = self.live[key]
        if count == 1:
            del self.live[key]
        else:
            self.live[key] = (nbytes, count - 1)


class _Held:
    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_what_a_tiled_block_keeps_stays_within_the_placements_workspace(kv_heads):
    """A Llama block's recompute and backward over one row of 256 positions in tiles of 32 (float64): the peak of
    what autograd saves (the keys and values, the residual after attention, one tile's graph) plus the gradient
    accumulators the backward keeps stays within the placement's workspace figure less the engine's three whole
    rows (the block's output, its gradient, the input's gradient), and fills at least 60% of it (the figure is
    not loose). Grouped heads (2 of 4) add HF's repeated keys of the CPU path, which CUDA kernels do not make."""
    seq, tile = 256, 32
    (_, tiled), stack, edges = _blocks("llama", {"num_key_value_heads": kv_heads}, tile)
    cfg = stack.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    x = torch.randn(1, seq, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        _, ctx = edges.head({"input_ids": torch.zeros(1, seq, dtype=torch.long),
                             "position_ids": torch.arange(seq)[None]})
    hooks = _LiveSaved({p.untyped_storage().data_ptr() for p in tiled.parameters()} | {x.untyped_storage().data_ptr()})
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
        out = tiled(x, stack.block_context(0, ctx))
        out.sum().backward()
    kept = hooks.peak + 2 * seq * kv_heads * head_dim * 8  # (and the keys' and values' accumulators)
    shapes = Shapes((0, 1), cfg.hidden_size, cfg.intermediate_size, attention_width=cfg.hidden_size,
                    kv_width=kv_heads * head_dim)
    figure = block_workspace(shapes, StepShape(seq, 1, seq), tile, 8) - 3 * seq * cfg.hidden_size * 8
    assert 0.6 * figure <= kept <= figure, (kept, figure)
