"""Sequence tiling of a block's MLP: the same outputs and gradients as the whole rows (float64), training that
equals HF's plain loop, and the planner tiling where whole rows do not fit the GPU."""

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
