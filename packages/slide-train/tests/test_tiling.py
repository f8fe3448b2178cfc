"""Sequence tiling of a block's MLP and the norms around it: the same outputs and gradients as whole rows
(float64) in every family, less saved for the backward, training that equals HF's plain loop and whole rows
(Llama, Gemma 2's window and soft-capping, Qwen3-MoE's load-balancing loss, packed documents), and the planner
tiling where whole rows do not fit the GPU."""

from __future__ import annotations

import copy
import pathlib
import traceback

import pytest
import torch
from conftest import (
    FAMILIES,
    MOE_FAMILIES,
    NEW_FAMILIES,
    save_tiny_model,
    tiny_config,
    whole_and_tiled,
    write_token_rows,
)
from test_equivalence import compare, make_rows, reference_run, slide_config
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from slide_train.config import load_config
from slide_train.launch import plan_run
from slide_train.machines import load_machine
from slide_train.models.adapter import HFStack
from slide_train.models.build import load_model
from slide_train.models.tiling import tile_layer
from slide_train.trainer import Trainer

# The norms each family's tiled MLP applies tile by tile (Llama's shape: the post-attention norm before it)
MLP_NORMS = {"gemma2": ["pre_feedforward_layernorm", "post_feedforward_layernorm"],
             "gemma3_text": ["pre_feedforward_layernorm", "post_feedforward_layernorm"],
             "olmo2": ["post_feedforward_layernorm"], "olmo3": ["post_feedforward_layernorm"]}
# HF's Gemma norms scale by (1 + weight.float()): their weights' gradients are fp32 sums over the tokens, which
# tiles add up in another order
FP32_SUMS = {"gemma", "gemma2", "gemma3_text"}


def _blocks(model_type: str, shape: str | None, tile: int):
    """Block 0's layer (or the first of `shape`) whole and tiled by `tile`, with the same float64 parameters,
    and its context from the head (float64 rotary tables and masks)."""
    def config_of():
        config = tiny_config(model_type)
        if model_type == "qwen3_moe":
            config.mlp_only_layers = [0]  # (a dense layer of a mixture, then sparse ones)
        return config

    return whole_and_tiled(config_of, tile, shape_of=lambda stack: shape)


def _run(block, edges, stack, seq: int):
    """Outputs, input gradient and parameter gradients of one forward and backward of `block` (float64)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 200, (2, seq), generator=g)
    with torch.no_grad():
        _, ctx = edges.head({"input_ids": ids, "position_ids": torch.arange(seq).expand(2, seq)})
    x = torch.randn(2, seq, stack.config.hidden_size, generator=g, dtype=torch.float64, requires_grad=True)
    out = block(x, stack.block_context(0, ctx))
    out.backward(torch.randn(out.shape, generator=g, dtype=torch.float64))
    return out.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}


@pytest.mark.parametrize("model_type", FAMILIES + NEW_FAMILIES + MOE_FAMILIES)
def test_a_tiled_block_gives_the_whole_rows_outputs_and_gradients(model_type):
    """Every family: its dense MLP with the norms around it runs over tiles (5, 5 and 3 positions); in float64 the
    block's outputs and all gradients equal whole rows', the parameters keep their names, and rows no longer than
    a tile give the untiled block's bits. A mixture's sparse layer is left whole."""
    from slide_train.models.tiling import mlp_norms

    (whole, tiled), stack, edges = _blocks(model_type, "dense" if model_type == "qwen3_moe" else None, 5)
    assert [n for n, _ in tiled.named_parameters()] == [n for n, _ in whole.named_parameters()]
    if model_type in MOE_FAMILIES[1:]:  # (every layer sparse: nothing to tile, nor runs in float64 here)
        assert not tile_layer(copy.deepcopy(whole.layer), 5) and mlp_norms(whole.layer)[1] is None
        assert "_tiled_own_forward" not in tiled.layer.post_attention_layernorm.__dict__
        return
    norms = MLP_NORMS.get(model_type, ["post_attention_layernorm"])
    assert [n for n, m in tiled.layer.named_children() if "_tiled_own_forward" in m.__dict__] == norms
    a, b = _run(whole, edges, stack, 13), _run(tiled, edges, stack, 13)
    torch.testing.assert_close(b[0], a[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(b[1], a[1], rtol=1e-12, atol=1e-12)
    for name, grad in a[2].items():
        fp32 = model_type in FP32_SUMS and name.endswith("norm.weight")
        tol = 1e-6 * grad.abs().max().item() if fp32 else 1e-12
        torch.testing.assert_close(b[2][name], grad, rtol=tol, atol=tol, msg=name)
    for p in (*whole.parameters(), *tiled.parameters()):
        p.grad = None
    a, b = _run(whole, edges, stack, 5), _run(tiled, edges, stack, 5)  # rows of one tile: bit for bit
    assert b[0].equal(a[0]) and b[1].equal(a[1])
    assert all(b[2][name].equal(grad) for name, grad in a[2].items())


def test_a_tiled_block_saves_neither_the_mlps_intermediates_nor_the_norms_output():
    """What a Llama block saves for its backward (saved-tensor hooks; parameters and the block's input left out):
    tiled, no tensor of the MLP's width, and at least the MLP's four intermediates (gate, up, activation, product)
    and the pre-MLP norm's output less per token than whole rows."""
    seq, tile = 32, 8
    (whole, tiled), stack, edges = _blocks("llama", None, tile)
    hidden, width = stack.config.hidden_size, stack.config.intermediate_size
    saved = {}
    for name, block in (("whole", whole), ("tiled", tiled)):
        x = torch.randn(1, seq, hidden, dtype=torch.float64, requires_grad=True)
        with torch.no_grad():
            _, ctx = edges.head({"input_ids": torch.zeros(1, seq, dtype=torch.long),
                                 "position_ids": torch.arange(seq)[None]})
        skip = {p.untyped_storage().data_ptr() for p in block.parameters()} | {x.untyped_storage().data_ptr()}
        kept = saved[name] = {}

        def pack(t, kept=kept, skip=skip):
            if t.untyped_storage().data_ptr() not in skip:
                kept[t.untyped_storage().data_ptr()] = t
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # (the forward's, not the tiles')
            out = block(x, stack.block_context(0, ctx))
        out.sum().backward()
    assert any(t.shape[-1] == width for t in saved["whole"].values())
    assert not any(width in t.shape for t in saved["tiled"].values())
    per_token = {k: sum(t.untyped_storage().nbytes() for t in v.values()) / seq / 8 for k, v in saved.items()}
    assert per_token["whole"] - per_token["tiled"] >= 4 * width + hidden


def test_training_with_tiled_mlps_equals_hf_and_whole_rows(tmp_path, monkeypatch):
    """A forced tile (8 of 32 positions per row): three clipped steps equal the plain loop with HF's loss, and
    the run with whole rows within fp32 summation order."""
    from test_equivalence import ACCUM, MICRO, SEQ, STEPS

    assert SEQ > 8
    from slide_train.models import tiling

    backward, tiles = tiling._Tiled.backward, []
    monkeypatch.setattr(tiling._Tiled, "backward", staticmethod(
        lambda ctx, grad: (tiles.append(grad.shape[1]), backward(ctx, grad))[1]))
    model = save_tiny_model(tmp_path / "model", "llama")
    rows, labels = make_rows(seed=1, n=STEPS * MICRO * ACCUM)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    runs = {}
    for tile in (8, 0):
        trainer = Trainer(slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl",
                                       output_dir=tmp_path / f"run-{tile}",
                                       **{"engine.placement.sequence_tile": tile}), progress=False)
        assert trainer.memory_plan.placement.sequence_tile == tile
        records = [trainer.step() for _ in range(STEPS)]
        runs[tile] = (records, trainer)
    ref_model, ref_losses, ref_norms = reference_run(model, rows, labels)
    records, trainer = runs[8]
    assert tiles and set(tiles) == {SEQ}  # every block's backward ran its MLP tile by tile (whole rows in)
    assert [r["loss"] for r in records] == pytest.approx(ref_losses, rel=1e-5)
    assert [r["grad_norm"] for r in records] == pytest.approx(ref_norms, rel=1e-5)
    compare(trainer, ref_model)
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in runs[0][0]], rel=1e-6)
    for _, t in runs.values():
        t.close()


def test_the_planner_tiles_where_whole_rows_do_not_fit_the_gpu():
    """Llama-3.1-8B, one row of 32k tokens under 14 GiB: whole rows' intermediates do not fit (even with one
    activation landing set), the MLP by tiles of 16,384 (the largest tried) does, its attention whole; forced off,
    the plan says it does not fit."""
    machine = load_machine(pathlib.Path(__file__).parents[3] / "docs" / "machines" / "h200-host.yaml")
    model = load_model("llama-3.1-8b", 0, need_tokenizer=False, need_weights=False)
    args = ["--model=llama-3.1-8b", "--seq_len=32768", "--micro_batch_size=1", "--grad_accum=1",
            "--engine.gpu_memory_limit_gb=14"]
    chosen = plan_run(load_config(None, args), model, machine, running=False)[0]
    whole = plan_run(load_config(None, [*args, "--engine.placement.sequence_tile=0"]), model, machine,
                     running=False)[0]
    assert chosen.fits and chosen.placement.sequence_tile == 16384 and not chosen.placement.query_tiles
    assert not whole.fits and whole.placement.sequence_tile == 0
    work = [p.placement.tiers()["gpu"]["workspace"] for p in (whole, chosen)]
    assert work[0] - work[1] == (32768 - 16384) * 4 * 14336 * 2  # the MLP's intermediates past a tile


# Tiled against whole rows: rows of four tiles, three steps clipped at 1.0, the same weights (fp32)
TILE = 6
TILED_RUNS = {
    "llama": ("llama", {}),
    "gemma2": ("gemma2", {}),  # (tiny_config: a window of 6, attention and final soft-capping)
    "qwen3_moe": ("qwen3_moe", {"mlp_only_layers": [0, 2], "output_router_logits": True,
                                "router_aux_loss_coef": 0.5}),
    "packed": ("llama", {}),
}


def _token_documents(path, seed: int, n: int) -> None:
    """Documents of 3 to 17 tokens, no labels: packing lays several in a row, cut at the rows' ends."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 18, (n,), generator=g).tolist()
    write_token_rows(path, [torch.randint(3, 259, (k,), generator=g).tolist() for k in lengths])


def global_relative_error(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over every parameter of two runs' masters ({unit: {name: tensor}})."""
    diff = sum(((a[u][n] - t).double().square().sum() for u in b for n, t in b[u].items()), torch.tensor(0.0))
    norm = sum((t.double().square().sum() for u in b for t in b[u].values()), torch.tensor(0.0))
    return (diff / norm).sqrt().item()


@pytest.mark.parametrize("name", list(TILED_RUNS))
def test_tiled_and_whole_rows_train_to_the_same_weights(tmp_path, monkeypatch, name):
    """A forced tile of a quarter of the row: three steps clipped at 1.0 give the whole rows' weights within
    1e-6 (global relative error over all parameters), with Gemma 2's window shorter than the row and its
    soft-capping, Qwen3-MoE's load-balancing loss over sparse and (tiled) dense layers, or packed documents."""
    from test_equivalence import ACCUM, MICRO, SEQ, STEPS

    from slide_train.models import tiling

    family, changes = TILED_RUNS[name]
    assert SEQ == 4 * TILE
    backward, tiles = tiling._Tiled.backward, []
    monkeypatch.setattr(tiling._Tiled, "backward", staticmethod(
        lambda ctx, grad: (tiles.append(grad.shape[1]), backward(ctx, grad))[1]))
    model = save_tiny_model(tmp_path / "model", family, changes=changes)
    data = tmp_path / "data.jsonl"
    if name == "packed":
        _token_documents(data, seed=4, n=STEPS * MICRO * ACCUM * 4)
    else:
        write_token_rows(data, *make_rows(seed=1, n=STEPS * MICRO * ACCUM))
    extra = {"max_grad_norm": 1.0, "data.pack": "true"} if name == "packed" else {"max_grad_norm": 1.0}
    masters, records = {}, {}
    for tile in (TILE, 0):
        trainer = Trainer(slide_config(tmp_path, tmp_path / "model", data, output_dir=tmp_path / f"run-{tile}",
                                       **{"engine.placement.sequence_tile": tile}, **extra), progress=False)
        records[tile] = [trainer.step() for _ in range(STEPS)]
        masters[tile] = {u: {n: t.clone() for n, t in views.items()}
                         for u, views in trainer.engine.named_masters().items()}
        trainer.close()
    assert tiles and set(tiles) == {SEQ}  # the tiled run's blocks ran their MLPs tile by tile
    assert any(r["grad_norm"] > 1.0 for r in records[0]), "clipping must act in this test"
    if name == "gemma2":
        config = tiny_config("gemma2")
        assert config.sliding_window < SEQ and config.attn_logit_softcapping and config.final_logit_softcapping
    if name == "qwen3_moe":
        assert all("aux_loss" in r for r in records[TILE])
    if name == "packed":  # rows really hold several documents
        from slide_train.data import build_data

        cfg = trainer.cfg
        batch = build_data(cfg.data, trainer.model.tokenizer, SEQ, MICRO, cfg.seed).train.next_micro_batch()
        assert (batch["document_ids"].amax(dim=1) > 0).all()
    assert [r["loss"] for r in records[TILE]] == pytest.approx([r["loss"] for r in records[0]], rel=1e-6)
    err = global_relative_error(masters[TILE], masters[0])
    if err >= 1e-6 and name != "packed":
        # Tiles sum each row's terms in another order, and AdamW's normalization amplifies that rounding by an
        # amount the CPU's vector width decides (Gemma 2's scaled embeddings round most): the floor is how far
        # torch's own fp32 loop lies from a float64 run of it.
        rows, labels = make_rows(seed=1, n=STEPS * MICRO * ACCUM)
        fp32, fp64 = (reference_run(model, rows, labels, dtype, clip=1.0)[0].state_dict()
                      for dtype in (torch.float32, torch.float64))
        floor = global_relative_error({"hf": fp32}, {"hf": {n: t.float() for n, t in fp64.items()}})
        assert err < 2 * floor, f"tiled rows {err:.2e} from whole rows, torch fp32 {floor:.2e} from float64"
    else:
        assert err < 1e-6


TESTS = str(pathlib.Path(__file__).resolve().parent)  # (frames of these tests are not the step's own)


class LargeTensors(TorchDispatchMode):
    """Every op's output of `limit` elements or more, with the op, its shape and the innermost frames of the
    project and transformers it ran from (views of a large tensor are left out: their base is what was made)."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.seen = limit, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.numel() >= self.limit:
                    frames = [f"{pathlib.Path(f.filename).name}:{f.name}" for f in traceback.extract_stack()
                              if ("slide_" in f.filename or "transformers" in f.filename)
                              and not f.filename.startswith(TESTS)]
                    self.seen.append((func.__name__, tuple(t.shape), frames[-3:]))
        return out


def _long_rows_run(tmp_path, model_type: str, seq: int, tile: int):
    """A trainer of one row of `seq` tokens a step, its blocks tiled by `tile` (0: whole rows), attention by query
    tiles too, on the CPU; the loss's token chunks a quarter of the row (its chunks are sized by bytes, which one
    tiny row never fills)."""
    save_tiny_model(tmp_path / "model", model_type, changes={"max_position_embeddings": seq})
    g = torch.Generator().manual_seed(0)
    write_token_rows(tmp_path / "data.jsonl", torch.randint(3, 259, (2, seq), generator=g).tolist())
    return Trainer(slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl", seq_len=seq,
                                micro_batch_size=1, grad_accum=1, steps=2, output_dir=tmp_path / f"run-{tile}",
                                **{"engine.placement.sequence_tile": tile, "engine.placement.query_tiles": "true"}),
                   progress=False)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_a_tiled_step_makes_nothing_of_a_rows_length_times_the_mlps_width_or_the_vocabulary(
        tmp_path, monkeypatch, model_type):
    """A training step of one 512-token row in tiles of 128 (Gemma 2 with its window of 6 and soft-capping): no
    tensor of S x intermediate or S x vocab elements or more is made anywhere (head, blocks, tail, optimizer). The
    large ones left are attention's of one query tile (at most 128 queries against the keys up to the tile's end:
    its dense mask on the CPU, HF's eager scores for Gemma 2) and, where the CPU runs attention densely, the head's
    S x S masks, which CUDA makes as a block mask (test_on_the_gpu_a_tiled_step_makes_nothing_of_a_rows_length_
    squared). S is such that the boundary activations (S x hidden), a unit's parameters and a tile's
    intermediates stay below the limit. Whole rows, the same step makes S x intermediate tensors: the check sees
    them."""
    seq, tile = 512, 128
    monkeypatch.setenv("SLIDE_LCE_CHUNK_TOKENS", str(tile))
    config = tiny_config(model_type)
    limit = seq * min(config.intermediate_size, seq, config.vocab_size)
    found = {}
    for t in (tile, 0):
        trainer = _long_rows_run(tmp_path, model_type, seq, t)
        assert max(u.layout.numel for u in trainer.engine.units) < limit and seq * config.hidden_size < limit
        trainer.step()  # (the first step's one-time allocations are not the question)
        with LargeTensors(limit) as large:
            trainer.step()
        trainer.close()
        found[t] = large.seen
    assert any(shape[-1] == config.intermediate_size for _, shape, _ in found[0])
    square = [s for s in found[tile] if s[1][-2:] == (seq, seq)]
    assert all(s[2][-1].endswith(("attention_mask", "additive_mask")) for s in square), square
    tiles = [s for s in found[tile] if s[1][-2] <= tile and s[1][-1] <= seq]
    assert [s for s in found[tile] if s not in square and s not in tiles] == []
    assert (tile, seq) in {s[1][-2:] for s in tiles}  # (the last tile's attention)
    if model_type == "llama":  # (plain causal rows: the head makes no mask)
        assert square == []


# 1/8 of Llama-3.1-8B's width, two layers: 16 heads of 32 (flash attention's backward keeps an fp32 gradient of the
# queries over the whole row, rows x heads x head_dim rounded up to 32: heads of 16 would double it), 4 key-value
# heads, intermediate 5.5 x hidden (so S x intermediate stands above that S-long buffer), a vocabulary that keeps
# the edges' fp32 tensors under the limits below
GPU_SHAPES = dict(hidden_size=512, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4,
                  head_dim=32, vocab_size=8192, num_hidden_layers=2)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_on_the_gpu_a_tiled_step_makes_nothing_of_a_rows_length_squared(tmp_path, monkeypatch, model_type):
    """On CUDA, one row of 16,384 tokens in tiles of 4096 (Gemma 2: a window of 4096 and soft-capping, through
    FlexAttention and a block mask): the CUDA allocator's trace of a training step holds no allocation as large as
    S x intermediate or S x vocab bf16 elements or S x S bytes. Whole rows, the same step allocates the MLP's
    S x intermediate tensors: the trace sees them."""
    if not torch.cuda.is_available():
        pytest.fail("this test needs a CUDA device: run it on the GPU machine (it is marked `gpu`)")
    seq, tile = 16384, 4096
    monkeypatch.setenv("SLIDE_LCE_CHUNK_TOKENS", "1024")  # (the loss's logits, 1024 x vocab at a time)
    changes = dict(GPU_SHAPES, max_position_embeddings=seq)
    if model_type == "gemma2":
        changes.update(sliding_window=4096, query_pre_attn_scalar=16)
    save_tiny_model(tmp_path / "model", model_type, changes=changes)
    write_token_rows(tmp_path / "data.jsonl", torch.randint(3, 259, (3, seq)).tolist())
    limit = min(2 * seq * GPU_SHAPES["intermediate_size"], seq * seq, 2 * seq * GPU_SHAPES["vocab_size"])
    found = {}
    for t in (tile, 0):
        trainer = Trainer(slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl", seq_len=seq,
                                       micro_batch_size=1, grad_accum=1, steps=3, output_dir=tmp_path / f"run-{t}",
                                       **{"engine.device": "cuda", "engine.placement.sequence_tile": t,
                                          "engine.placement.query_tiles": "true"}),
                          progress=False)
        trainer.step()  # (compiles FlexAttention; one-time allocations)
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=200_000)
        try:
            trainer.step()
            torch.cuda.synchronize()
            trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        trainer.close()
        found[t] = [(e["size"], [f"{pathlib.Path(f['filename']).name}:{f['name']}" for f in e["frames"]
                                 if "slide_" in f["filename"] or "transformers" in f["filename"]][:3])
                    for e in trace if e["action"] == "alloc" and e["size"] >= limit]
        print(f"{model_type}, tile {t}: {len(trace)} trace entries; largest allocation "
              f"{max(e['size'] for e in trace if e['action'] == 'alloc') / 2**20:.1f} MiB (limit {limit / 2**20:.1f})")
    assert any(size >= 2 * seq * GPU_SHAPES["intermediate_size"] for size, _ in found[0])
    assert found[tile] == [], found[tile]


@pytest.mark.parametrize("base, factor", [("llama-3.1-8b", 8.0), ("llama-3.2-3b", 32.0)])
def test_the_256k_presets_are_their_models_with_262144_positions_and_llama3_rope_scaling(base, factor):
    """`-256k`: the same config but for max_position_embeddings (262,144) and rope_parameters (rope_type llama3
    with the release's factor), so the same parameters; its rotary table keeps the short wavelengths and
    stretches the long ones by the factor."""
    from slide_train.models.presets import preset_config

    short, long = preset_config(base), preset_config(f"{base}-256k")
    a, b = short.to_dict(), long.to_dict()
    assert {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)} == {"max_position_embeddings", "rope_parameters"}
    assert (a["max_position_embeddings"], b["max_position_embeddings"]) == (131072, 262144)
    assert b["rope_parameters"] == {"rope_type": "llama3", "rope_theta": a["rope_parameters"]["rope_theta"],
                                    "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192}
    model = load_model(f"{base}-256k", 0, need_tokenizer=False, need_weights=False)
    stacks = [HFStack(config, None) for config in (short, long)]
    shapes = [[(n, p.shape) for n, p in s.make_block().named_parameters()] for s in stacks]
    assert shapes[0] == shapes[1] and model.hf_config.max_position_embeddings == 262144
    plain, scaled = (s.make_edges().rotary.inv_freq for s in stacks)
    assert scaled[0] == plain[0] and scaled[-1] == pytest.approx(plain[-1] / factor)
