"""Packed rows and sliding windows: the FlexAttention BlockMask the head builds on CUDA says exactly what the dense
mask says, and a packed row through the blocks gives each document's loss and gradients as HF computes them for
that document alone (on the CPU through the dense mask, on CUDA through FlexAttention)."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import save_tiny_model
from torch.nn.attention.flex_attention import flex_attention

from slide_memory import FlatLayout
from slide_train.models import attention, backends
from slide_train.models.adapter import HFStack, block_hf_name, edge_hf_name
from slide_train.models.weights import SafetensorsWeights

LENGTHS = [70, 400, 3, 150, 41, 129]  # documents crossing tiles, one holding two whole tiles, one a tile and a position


def packed_documents(seq: int, lengths, batch: int = 2) -> torch.Tensor:
    """[batch, seq] document ids: the lengths one after another from a shifted start per row (the last one cut),
    then 17 positions of padding (-1)."""
    rows, end = [], seq - 17
    for b in range(batch):
        ids = []
        for doc, n in enumerate(lengths[b:] + lengths[:b]):
            ids += [doc] * min(n, end - len(ids))
        rows.append(ids + [-1] * (seq - len(ids)))
    return torch.tensor(rows)


def tiles(mask, num: str, idx: str, tiles_q: int, tiles_kv: int) -> torch.Tensor:
    """[B, tiles_q, tiles_kv] booleans from a BlockMask's (count, indices) pair."""
    count, order = getattr(mask, num)[:, 0], getattr(mask, idx)[:, 0]
    out = torch.zeros(count.shape[0], tiles_q, tiles_kv, dtype=torch.bool)
    for b in range(count.shape[0]):
        for q in range(tiles_q):
            out[b, q, order[b, q, : count[b, q]].long()] = True
    return out


def to_positions(mask, seq: int) -> torch.Tensor:
    """What FlexAttention computes with the mask, per position: whole tiles allowed, partial tiles by the rule."""
    n = -(-seq // attention.TILE)
    partial = tiles(mask, "kv_num_blocks", "kv_indices", n, n)
    whole = tiles(mask, "full_kv_num_blocks", "full_kv_indices", n, n)
    assert not (partial & whole).any()

    def expand(t):
        return t.repeat_interleave(attention.TILE, 1).repeat_interleave(attention.TILE, 2)[:, :seq, :seq]

    b = torch.arange(partial.shape[0])[:, None, None]
    pos = torch.arange(seq)
    rule = mask.mask_mod(b, torch.zeros((), dtype=torch.long), pos[None, :, None], pos[None, None, :])
    return expand(whole) | expand(partial) & rule


@pytest.mark.parametrize("seq, window, documents", [
    (512, None, True), (300, None, True), (300, 8, True), (300, 100, True), (640, 200, True), (640, 300, True),
    (512, 129, False), (300, None, False)])
def test_block_mask_allows_what_the_dense_mask_allows(seq, window, documents):
    docs = packed_documents(seq, LENGTHS) if documents else None
    mask = attention.block_mask(docs, window, seq, "cpu")
    dense = attention.attention_mask(docs, window, seq, "cpu")
    if dense is None:
        dense = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None]
    allowed = to_positions(mask, seq)
    assert torch.equal(allowed, dense[:, 0].expand_as(allowed))
    # and sparse: with documents in order and no window, exactly the tiles holding an allowed pair are visited,
    # and exactly the tiles allowed whole skip the rule
    n = -(-seq // attention.TILE)
    whole = tiles(mask, "full_kv_num_blocks", "full_kv_indices", n, n)
    seen = tiles(mask, "kv_num_blocks", "kv_indices", n, n) | whole
    padded = torch.zeros(allowed.shape[0], n * attention.TILE, n * attention.TILE, dtype=torch.int8)
    padded[:, :seq, :seq] = allowed.to(torch.int8)
    counts = padded.view(-1, n, attention.TILE, n, attention.TILE).sum(dim=(2, 4))
    if window is None:
        assert torch.equal(seen, counts > 0)
        below = torch.arange(n)[:, None] > torch.arange(n)[None, :]
        size = (seq - torch.arange(n) * attention.TILE).clamp(max=attention.TILE)  # positions per tile
        assert torch.equal(whole, (counts == size[:, None] * size[None, :]) & below)
    else:
        assert (seen | ~(counts > 0)).all() and seen.sum() < allowed.shape[0] * n * (n + 1) // 2
    if seq >= 512 and (window is None or window >= 2 * attention.TILE):
        assert whole.any()


@pytest.mark.parametrize("window, softcap", [(None, None), (6, None), (6, 50.0), (None, 30.0)])
def test_a_mask_without_documents_serves_every_row_of_the_batch(window, softcap):
    """A BlockMask without documents is one row broadcast over the batch; FlexAttention's own dense path (what
    runs where it is not compiled) calls its rule with every row's index, and `attend` must give each row the
    float64 attention of its causal (windowed) scores, soft-capped where asked."""
    g = torch.Generator().manual_seed(0)
    batch, heads, seq, dim = 3, 2, 24, 8
    q, k, v = (torch.randn(batch, heads, seq, dim, generator=g) for _ in range(3))
    mask = attention.block_mask(None, window, seq, "cpu")
    score_mod = backends._soft_cap(softcap) if softcap is not None else None
    out = flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, scale=dim ** -0.5).transpose(1, 2)
    scores = (q.double() @ k.double().transpose(-1, -2)) * dim ** -0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(seq)
    allowed = (pos[:, None] >= pos[None, :]) & ((pos[:, None] - pos[None, :] < window) if window else True)
    expected = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1) @ v.double()
    torch.testing.assert_close(out.double(), expected.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_padding_sees_only_itself_and_every_row_sees_something():
    docs = packed_documents(300, LENGTHS)
    allowed = to_positions(attention.block_mask(docs, None, 300, "cpu"), 300)
    pad = docs < 0
    assert pad.any()
    eye = torch.eye(300, dtype=torch.bool).expand_as(allowed)
    assert torch.equal(allowed[pad], eye[pad])
    assert allowed.any(dim=-1).all()


def stack_loss(directory, batch: dict, device: str):
    """Summed loss of `batch` through the adapter's head, blocks and tail (fp32, on `device`), and the gradient
    of every parameter under its checkpoint name."""
    config = transformers.AutoConfig.from_pretrained(directory)
    stack = HFStack(config, SafetensorsWeights(directory))
    edges = stack.make_edges()
    edges.rotary.to(device)
    modules = [(edges, stack.load_edges, lambda n: edge_hf_name(n, stack.family))]
    for i in range(stack.num_blocks):
        modules.append((stack.make_block(), lambda p, i=i: stack.load_block(i, p),
                        lambda n, i=i: block_hf_name(i, n, stack.family)))
    grads = {}
    for module, load, _ in modules:
        layout = FlatLayout(module)
        flat = torch.zeros(layout.numel, device=device)
        grad = torch.zeros_like(flat)
        layout.bind(module, flat, grad)
        with torch.no_grad():
            load(layout.views(flat))
        grads[id(module)] = (layout, grad)
    batch = {k: v.to(device) for k, v in batch.items()}
    hidden, ctx = edges.head(batch)
    for i, (block, _, _) in enumerate(modules[1:]):
        hidden = block(hidden, stack.block_context(i, ctx))
    loss = edges.tail(hidden, batch, 1.0, ctx)
    loss.backward()
    named = {}
    for module, _, name in modules:
        layout, grad = grads[id(module)]
        named |= {name(n): g.cpu() for n, g in layout.views(grad).items()}
    return loss.item(), named


def reference_loss(model, docs: torch.Tensor, ids: torch.Tensor):
    """Each document on its own through HF's model, its loss summed over next-token targets, and the
    parameters' gradients."""
    model.zero_grad()
    total = 0.0
    for b in range(docs.shape[0]):
        for d in docs[b].unique():
            if d < 0:
                continue
            tokens = ids[b, docs[b] == d][None]
            if tokens.shape[1] < 2:
                continue
            logits = model(input_ids=tokens).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:], reduction="sum")
            loss.backward()
            total += loss.item()
    return total, {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}


def packed_batch(docs: torch.Tensor, vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, docs.shape, generator=g)
    position = torch.zeros_like(docs)
    targets = torch.full_like(docs, -100)
    for b in range(docs.shape[0]):
        for d in docs[b].unique():
            where = (docs[b] == d).nonzero().squeeze(1)
            position[b, where] = torch.arange(len(where)) if d >= 0 else 0
            if d >= 0:
                targets[b, where[:-1]] = ids[b, where[1:]]
    return {"input_ids": ids, "position_ids": position, "targets": targets, "document_ids": docs}


def check_packed_equals_documents(tmp_path, family: str, device: str, seq: int):
    model = save_tiny_model(tmp_path / "m", family).to(device)
    docs = packed_documents(seq, LENGTHS)
    batch = packed_batch(docs, model.config.vocab_size)
    ours, our_grads = stack_loss(tmp_path / "m", batch, device)
    theirs, their_grads = reference_loss(model, docs.to(device), batch["input_ids"].to(device))
    print(f"{family}: packed {ours}, each document alone {theirs}")
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert set(their_grads) <= set(our_grads)
    for name, g in their_grads.items():
        torch.testing.assert_close(our_grads[name], g, rtol=1e-3, atol=1e-4, msg=name)
    # the documents matter: one document across each whole row gives another loss
    whole = dict(batch, document_ids=torch.zeros_like(docs), position_ids=torch.arange(seq).expand_as(docs))
    leaked = stack_loss(tmp_path / "m", whole, device)[0]
    print(f"{family}: one document per row {leaked}")
    assert leaked != ours and abs(leaked - ours) > 10 * abs(ours - theirs)


@pytest.mark.parametrize("family", ["llama", "phi3", "gemma2", "gemma3_text"])
def test_packed_rows_give_each_documents_own_loss_and_gradients(tmp_path, family):
    """The dense path (CPU); phi3, gemma2 and gemma3_text have windows shorter than the documents."""
    check_packed_equals_documents(tmp_path, family, "cpu", 300)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "mistral", "phi3", "gemma2", "gemma3_text"])
def test_packed_rows_through_flex_attention_on_cuda(tmp_path, family):
    """FlexAttention with the BlockMask (soft-capping as its score rule for Gemma 2), fp32 on CUDA."""
    if not torch.cuda.is_available():
        pytest.fail("this test needs a CUDA device: run it on the GPU machine (it is marked `gpu`)")
    torch.backends.cuda.matmul.allow_tf32 = False
    check_packed_equals_documents(tmp_path, family, "cuda", 640)
