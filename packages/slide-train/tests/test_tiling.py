"""Sequence tiling of a block's MLP: the same outputs and gradients as the whole rows (float64), training that
equals HF's plain loop and whole rows (Llama, Gemma 2's window and soft-capping, Qwen3-MoE's load-balancing loss,
packed documents), and the planner tiling where whole rows do not fit the GPU."""

from __future__ import annotations

import copy
import pathlib

import pytest
import torch
import transformers
from conftest import save_tiny_model, tiny_config, write_token_rows
from test_equivalence import compare, make_rows, reference_run, slide_config

from slide_train.config import load_config
from slide_train.machines import load_machine
from slide_train.models.build import load_model
from slide_train.models.tiling import tile_mlp
from slide_train.trainer import Trainer, plan_run


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_tiled_mlp_gives_the_whole_rows_outputs_and_gradients(family):
    config = tiny_config(family)
    if family == "qwen3_moe":
        config.mlp_only_layers = [0]  # (a dense layer of a mixture: tiled like any other)
    torch.manual_seed(0)
    layer = transformers.AutoModelForCausalLM.from_config(config).model.layers[0].mlp.double()
    tiled = copy.deepcopy(layer)
    tile_mlp(tiled, 5)  # (tiles of 5, 5 and 3 positions)
    x = torch.randn(2, 13, config.hidden_size, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    grad = torch.randn(2, 13, config.hidden_size, dtype=torch.float64)
    out, out2 = layer(x), tiled(x2)
    torch.testing.assert_close(out2, out, rtol=1e-12, atol=1e-12)
    out.backward(grad)
    out2.backward(grad)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-12, atol=1e-12)
    for (name, a), b in zip(layer.named_parameters(), tiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12, msg=name)
    short = torch.randn(2, 4, config.hidden_size, dtype=torch.float64)
    assert tiled(short).equal(layer(short))  # rows no longer than a tile: the MLP as it is


def test_training_with_tiled_mlps_equals_hf_and_whole_rows(tmp_path, monkeypatch):
    """A forced tile (8 of 32 positions per row): three clipped steps equal the plain loop with HF's loss, and
    the run with whole rows within fp32 summation order."""
    from test_equivalence import ACCUM, MICRO, SEQ, STEPS

    assert SEQ > 8
    from slide_train.models import tiling

    backward, tiles = tiling._TiledMLP.backward, []
    monkeypatch.setattr(tiling._TiledMLP, "backward", staticmethod(
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
    """Llama-3.1-8B, one row of 32k tokens under 16 GiB: whole rows' MLP intermediates do not fit, tiles of 4096
    do; forced off, the plan says it does not fit."""
    machine = load_machine(pathlib.Path(__file__).parents[3] / "docs" / "machines" / "h200-host.yaml")
    model = load_model("llama-3.1-8b", 0, need_tokenizer=False, need_weights=False)
    args = ["--model=llama-3.1-8b", "--seq_len=32768", "--micro_batch_size=1", "--grad_accum=1",
            "--engine.gpu_memory_limit_gb=16"]
    chosen = plan_run(load_config(None, args), model, machine, running=False)[0]
    whole = plan_run(load_config(None, [*args, "--engine.placement.sequence_tile=0"]), model, machine,
                     running=False)[0]
    assert chosen.fits and chosen.placement.sequence_tile == 4096
    assert not whole.fits and whole.placement.sequence_tile == 0
    work = [p.placement.tiers()["gpu"]["workspace"] for p in (whole, chosen)]
    assert work[0] - work[1] == (32768 - 4096) * 4 * 14336 * 2  # the MLP's intermediates


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
    backward, tiles = tiling._TiledMLP.backward, []
    monkeypatch.setattr(tiling._TiledMLP, "backward", staticmethod(
        lambda ctx, grad: (tiles.append(grad.shape[1]), backward(ctx, grad))[1]))
    save_tiny_model(tmp_path / "model", family, changes=changes)
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
    assert global_relative_error(masters[TILE], masters[0]) < 1e-6
