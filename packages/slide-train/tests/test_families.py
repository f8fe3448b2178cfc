"""The families of the declarative table (Phi-3, OLMo 2 and 3, Granite, Gemma, Gemma 2, Gemma 3 text) against
transformers: three clipped, accumulated steps equal a plain PyTorch loop over the HF model with HF's own loss;
the export loads with `from_pretrained` and gives the trained masters' logits; a resumed run is the uninterrupted
one bit for bit; unsupported checkpoints are refused with the reason."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers
from conftest import NEW_FAMILIES, save_tiny_model, tiny_config, write_token_rows
from test_equivalence import (
    ACCUM,
    CLIP,
    MICRO,
    SEQ,
    STEPS,
    assert_bf16_tracks_fp32,
    compare,
    make_rows,
    reference_run,
    slide_config,
)

from slide_train.batches import prepare
from slide_train.cli import main
from slide_train.errors import ModelError
from slide_train.export import hf_tensors
from slide_train.models.adapter import HFStack, block_hf_name, edge_hf_name
from slide_train.models.build import load_model
from slide_train.models.families import FAMILIES
from slide_train.models.presets import preset_config
from slide_train.models.random_init import RandomWeights
from slide_train.trainer import Trainer


def eval_batch(rows, labels):
    ids, lab = torch.tensor(rows[:2]), torch.tensor(labels[:2])
    micro = [prepare({"input_ids": ids, "labels": lab, "position_ids": torch.arange(SEQ).expand(2, SEQ),
                      "document_ids": torch.zeros(2, SEQ, dtype=torch.long)})]
    return ids, lab, micro, int((micro[0]["targets"] != -100).sum())


def assert_resumes_bit_for_bit(tmp_path, whole: Trainer) -> None:
    """Two steps of `whole` (a run on tmp_path's model and data), a checkpoint and a third step; a run resumed
    from the checkpoint ends its third step with the same masters and AdamW states, bit for bit."""
    for _ in range(2):
        whole.step()
    path = whole.save_checkpoint()
    whole.step()
    whole.engine.synchronize()
    resumed = Trainer(slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl",
                                   output_dir=tmp_path / "resumed", resume=path), progress=False)
    assert resumed.step_index == 2
    resumed.step()
    resumed.engine.synchronize()
    want, got = dict(hf_tensors(whole.engine.named_masters())), dict(hf_tensors(resumed.engine.named_masters()))
    assert want.keys() == got.keys() and all(got[k].equal(t) for k, t in want.items())
    for u in range(len(whole.engine.units)):
        a, b = whole.engine.optimizer_state(u), resumed.engine.optimizer_state(u)
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    whole.close()
    resumed.close()


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_three_steps_match_plain_pytorch_and_the_export_loads(tmp_path, family):
    model = save_tiny_model(tmp_path / "model", family)
    rows, labels = make_rows(seed=1, n=STEPS * MICRO * ACCUM)
    rows[0][SEQ // 2] = rows[5][3] = model.config.pad_token_id or 3  # the pad row's gradient is zero in HF
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    trainer = Trainer(slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl",
                                   **{"engine.placement.window": 2}), progress=False)
    records = [trainer.step() for _ in range(STEPS)]
    ref_model, ref_losses, ref_norms = reference_run(model, rows, labels)
    assert [r["loss"] for r in records] == pytest.approx(ref_losses, rel=1e-5)
    assert [r["grad_norm"] for r in records] == pytest.approx(ref_norms, rel=1e-5)
    assert all(r["grad_norm"] > CLIP for r in records), "clipping must be active in this test"
    compare(trainer, ref_model, reference_run(model, rows, labels, torch.float64)[0])

    out = trainer.export(tmp_path / "export")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert loaded.config.model_type == family and type(loaded).__name__ == type(model).__name__
    state = dict(hf_tensors(trainer.engine.named_masters()))
    fresh = transformers.AutoModelForCausalLM.from_config(loaded.config).float()
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    fresh.tie_weights()
    ids, lab, micro, n = eval_batch(rows, labels)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, fresh(ids).logits, rtol=1e-5, atol=1e-5)
        hf_loss = loaded(ids, labels=lab).loss.item()
    assert trainer.engine.evaluate(micro, normalizer=n) == pytest.approx(hf_loss, rel=1e-5)
    if getattr(loaded.config, "sliding_window", None):  # the windows are shorter than the rows: they count here
        loaded.config.sliding_window = SEQ
        with torch.no_grad():
            assert abs(loaded(ids, labels=lab).loss.item() - hf_loss) > 1e-4
    trainer.close()


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe"])
def test_bf16_compute_on_the_cpu_stays_within_the_familys_tolerance(tmp_path, family):
    """The bf16 check the GPU tests make for every family (test_gpu.py), here on the CPU's torch path."""
    assert_bf16_tracks_fp32(tmp_path, family, "cpu")


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_mixed_layer_types_resume_bit_for_bit(tmp_path, family):
    """Sliding and global layers alternate (Gemma 3 with its own rotary base for each): two steps, a checkpoint,
    and one resumed step give the three-step run's masters and AdamW states exactly."""
    save_tiny_model(tmp_path / "model", family)
    rows, labels = make_rows(seed=4, n=STEPS * MICRO * ACCUM)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    whole = Trainer(slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl",
                                 output_dir=tmp_path / "whole"), progress=False)
    stack = HFStack(whole.model.hf_config, None)
    assert len(set(stack.layer_types)) == 2 and stack.windows["sliding_attention"] < SEQ
    assert_resumes_bit_for_bit(tmp_path, whole)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_every_family_reads_and_writes_the_checkpoints_names(model_type):
    """What the engine loads and exports is named as the HF model's state dict, tensor for tensor, shape for
    shape (a tied lm head is the embedding's)."""
    config = tiny_config(model_type)
    stack = HFStack(config, None)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config).state_dict()
    ours = {edge_hf_name(n, stack.family): tuple(p.shape) for n, p in stack.make_edges().named_parameters()}
    block = stack.make_block()
    for i in range(config.num_hidden_layers):
        ours |= {block_hf_name(i, n, stack.family): tuple(p.shape) for n, p in block.named_parameters()}
    want = {k: tuple(v.shape) for k, v in hf.items() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    assert ours == want
    # export writes with the default names: a family with other names must change it first
    assert all(edge_hf_name(n) == edge_hf_name(n, stack.family) for n in ("embed_tokens.weight", "norm.weight"))
    assert block_hf_name(1, "layer.x") == block_hf_name(1, "layer.x", stack.family)


def test_refused_checkpoints_say_why(tmp_path):
    def model_dir(name, config: dict):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        return str(tmp_path / name)

    multimodal = transformers.Gemma3Config(text_config=tiny_config("gemma3_text").to_dict())
    multimodal.save_pretrained(tmp_path / "gemma3")
    with pytest.raises(ModelError, match=r"only the text models are \(model_type gemma3_text"):
        load_model(str(tmp_path / "gemma3"))
    remote = model_dir("remote", {"model_type": "mymodel", "auto_map": {"AutoConfig": "configuration_my.MyConfig"}})
    with pytest.raises(ModelError, match=r"names its own modeling code .* remote code are not supported.*gemma2"):
        load_model(remote)
    # A supported model_type that also carries an auto_map loads with transformers' classes.
    phi3 = tiny_config("phi3").to_dict() | {"auto_map": {"AutoConfig": "configuration_phi3.Phi3Config"}}
    assert load_model(model_dir("phi3", phi3), need_tokenizer=False, need_weights=False).hf_config.model_type == "phi3"
    dropout = tiny_config("phi3")
    dropout.resid_pdrop = 0.1
    with pytest.raises(ModelError, match=r"dropout \(resid_pdrop=0.1\)"):
        HFStack(dropout, None)
    gpt2 = model_dir("gpt2", transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).to_dict())
    with pytest.raises(ModelError, match=r"'gpt2' has no adapter yet; supported: llama .*phi3 .*olmo2 .*granite "
                                         r".*gemma2 .*gemma3_text"):
        load_model(gpt2)


def test_the_torch_path_warning_names_only_what_is_left(capsys):
    """engine.kernels on a family slide-kernels fuses everywhere: no warning. On a mixture of experts whose
    experts the families table leaves to transformers (FUSED_EXPERTS off): one line saying the experts run the
    torch path (the norms and RoPE are fused); with them fused, none."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stack = HFStack(tiny_config("gemma2"), None, kernels=True)
    assert stack.kernels and stack.attn_softcap == 5.0
    assert getattr(stack.make_block().layer.mlp, "_slide_kernels_patched", False)
    if FAMILIES["olmoe"].unfused:
        with pytest.warns(UserWarning, match=r"OLMoE \(olmoe\) runs slide-kernels' fused RMSNorm and RoPE; the "
                                             r"experts \(transformers' grouped matmuls\) run the torch path"):
            assert HFStack(tiny_config("olmoe"), None, kernels=True).kernels
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert HFStack(tiny_config("olmoe"), None, kernels=True).kernels
    # `slide-train plan` on a GPU machine (kernels auto) says so too, and only there
    assert main(["plan", "--model=olmoe-1b-7b", "--seq_len=1024", "--micro_batch_size=1"]) == 0
    out, err = capsys.readouterr()
    assert "olmoe" in out and ("torch path" in err) == bool(FAMILIES["olmoe"].unfused)
    assert main(["plan", "--model=gemma-2-2b", "--seq_len=1024", "--micro_batch_size=1"]) == 0
    out, err = capsys.readouterr()
    assert "gemma2" in out and "torch path" not in err


def test_gemma_presets_start_from_neutral_norms():
    weights = RandomWeights(preset_config("gemma-3-1b"), seed=0)
    norm = torch.empty(1152)
    weights.read_into("model.norm.weight", norm)
    assert norm.eq(0).all()  # Gemma's norms scale by 1 + weight
