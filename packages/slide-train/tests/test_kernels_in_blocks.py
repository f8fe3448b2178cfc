"""engine.kernels=on in every family: slide-kernels' patch of the family's model type is what a tiny HF model of it
gets, module for module; each op the family runs fused is what the blocks' modules run (traced to slide-kernels'
op, which launches its Triton kernel on CUDA and takes its torch path here), the final norm's too; the neutral
norm weight scales by one; and two training steps end where the same run with kernels off does; for Gemma 3 and
OLMoE also with the Triton kernels themselves, in Triton's interpreter."""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch
import transformers
from conftest import FAMILIES as LLAMA_LIKE
from conftest import save_tiny_model, tiny_config, write_token_rows
from test_equivalence import MICRO, SEQ, make_rows, slide_config

import slide_kernels
from slide_train.export import hf_tensors
from slide_train.models.adapter import HFStack
from slide_train.models.families import FAMILIES
from slide_train.trainer import Trainer

ALL = LLAMA_LIKE + [f for f in FAMILIES if f not in LLAMA_LIKE]
# Each op by the torch fallback its public function calls on the CPU (`partial_rope`'s calls `rope`'s too).
FALLBACKS = {"rms_norm": ("rms_norm", "rms_norm_torch"), "rope": ("rope", "rope_torch"),
             "partial_rope": ("rope", "partial_rope_torch"), "swiglu": ("swiglu", "swiglu_torch"),
             "swiglu_gate_up": ("swiglu", "swiglu_gate_up_torch"), "geglu": ("geglu", "geglu_torch"),
             "moe_experts": ("moe_experts", "moe_experts_torch")}


@pytest.fixture
def hf_rope():
    """apply_to swaps `apply_rotary_pos_emb` in transformers' modeling modules for the whole process: the
    modules as they were come back after the test (the reference runs must see HF's own)."""
    before = {name: mod.apply_rotary_pos_emb for name, mod in list(sys.modules.items())
              if name.startswith("transformers.models.") and hasattr(mod, "apply_rotary_pos_emb")}
    yield
    for name, fn in before.items():
        sys.modules[name].apply_rotary_pos_emb = fn


def _layer_module(stack: HFStack):
    """The transformers modeling module of the stack's layer class (imported, so hf_rope sees it)."""
    return importlib.import_module(stack._layer_cls.__module__)


def _count(monkeypatch) -> dict[str, int]:
    calls = dict.fromkeys(FALLBACKS, 0)
    for op, (module_name, fallback) in FALLBACKS.items():
        module = importlib.import_module(f"slide_kernels.ops.{module_name}")
        original = getattr(module, fallback)

        def counting(*args, _op=op, _fn=original, **kwargs):
            calls[_op] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(module, fallback, counting)
    return calls


def _materialized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """`module` (built on the meta device) with random parameters on the CPU."""
    module.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return module


# The module class whose forward apply_to puts on a gated MLP or experts module, by op.
MLP_FORWARDS = {"swiglu": slide_kernels.SwiGLUMLP, "geglu": slide_kernels.GeGLUMLP,
                "swiglu_gate_up": slide_kernels.SwiGLUGateUpMLP, "moe_experts": slide_kernels.MoEExperts}


def _replaced_op(line: str) -> str:
    """The slide_kernels op of one line of apply_to's report ("<what>.forward -> slide_kernels.<op>...")."""
    return line.split("-> slide_kernels.")[1].split()[0]


@pytest.mark.parametrize("model_type", ALL)
def test_each_family_gets_the_patch_slide_kernels_declares(model_type, monkeypatch):
    """apply_to on a tiny HF model of each family slide-train supports replaces exactly what slide-kernels
    declares for the model type: every RMSNorm, each layer's MLP (or experts) with the declared op, the modeling
    module's rotary function with the declared one, and the loss; nothing else."""
    patch = slide_kernels.family_patch(model_type)
    assert patch is not None and FAMILIES[model_type].patch == patch
    config = tiny_config(model_type)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    modeling = importlib.import_module(type(model).__module__)
    # (apply_to swaps the rotary function module-wide, and an earlier test of this process may have left it
    # swapped: a stand-in of HF's goes in first, so the swap shows; what was there comes back after the test)
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", lambda q, k, cos, sin, *args, **kwargs: (q, k))
    report = slide_kernels.apply_to(model)

    replaced = [_replaced_op(line) for line in report]
    layers = config.num_hidden_layers
    assert sorted(replaced) == sorted(["rms_norm"] * len(norms) + [patch.mlp] * layers
                                      + [patch.rope.__name__, "linear_cross_entropy"])
    assert all(getattr(m, "_slide_kernels_patched", False) for m in norms)
    mlp_cls = MLP_FORWARDS[patch.mlp]
    for layer in model.model.layers:
        forwards = [m for m in layer.modules() if getattr(m.forward, "__func__", None) is mlp_cls.forward]
        assert len(forwards) == 1, type(layer).__name__
    assert modeling.apply_rotary_pos_emb is patch.rope
    assert getattr(model, "_slide_kernels_patched", False)


@pytest.mark.parametrize("model_type", ALL)
def test_the_neutral_norm_weight_scales_by_one(model_type):
    """Random init's neutral norm weight (from slide-kernels' norm offset) makes each HF norm of the family the
    bare normalization: Gemma's (1 + weight) norms at 0, the others at 1."""
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type)).float()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(8), dtype=torch.float32)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms
    for m in norms:
        with torch.no_grad():
            m.weight.fill_(FAMILIES[model_type].norm_init)
            xs = x[..., : m.weight.shape[0]]
            eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
            want = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps)
            torch.testing.assert_close(m(xs), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("model_type", ALL)
def test_each_declared_op_is_what_the_blocks_run(model_type, monkeypatch, hf_rope):
    family = FAMILIES[model_type]
    # The torch-path warning names only what is left there: a mixture's experts where the table leaves them to
    # transformers (families.FUSED_EXPERTS off), nothing otherwise.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stack = HFStack(tiny_config(model_type), None, kernels=True)
    said = [str(w.message) for w in caught if "engine.kernels" in str(w.message)]
    if family.unfused:
        assert family.experts and "moe_experts" not in family.fused
        assert len(said) == 1 and "the experts" in said[0] and "torch path" in said[0]
        assert "fused RMSNorm and RoPE" in said[0]
    else:
        assert said == []
    assert stack.kernels and family.fused
    block = _materialized(stack.make_block(), seed=1)
    layer = block.layer
    # A mixture's experts module runs slide-kernels' moe_experts exactly where the table says so.
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    assert (experts is not None) == bool(family.experts)
    if experts is not None:
        fused = getattr(experts.forward, "__func__", None) is slide_kernels.MoEExperts.forward
        assert fused == ("moe_experts" in family.fused)
    norms = [m for m in layer.modules() if type(m).__name__.endswith("RMSNorm")]
    # Every norm of the layer (q/k norms and post-norms too) and the edges' final norm are patched, and each
    # patched norm casts as its HF class does (bf16 shows the rounding order).
    edges = stack.make_edges()
    for m in [*norms, edges.norm]:
        assert getattr(m, "_slide_kernels_patched", False), type(m).__name__
    x = (torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(2)) * 3).bfloat16()
    for m in norms:
        m16 = _materialized_like(m)
        xs = x[..., : m16.weight.shape[0]]
        assert torch.equal(m16(xs), type(m16).forward(m16, xs)), type(m).__name__
    rope_op = next(op for op in family.fused if "rope" in op)
    assert _layer_module(stack).apply_rotary_pos_emb.__name__ == rope_op
    assert _layer_module(stack).apply_rotary_pos_emb.__module__ == "slide_kernels.ops.rope"

    # One forward of the block: each declared op runs once per module of its kind, nothing else of ours runs.
    calls = _count(monkeypatch)
    ctx = _context(stack)
    hidden = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    block(hidden, ctx).sum().backward()
    mlp_ops = [op for op in family.fused if op in ("swiglu", "swiglu_gate_up", "geglu", "moe_experts")]
    rotates = "rope" if rope_op == "rope_cast_back" else rope_op  # (rope_cast_back is rope's, cast back)
    want = dict.fromkeys(FALLBACKS, 0) | {"rms_norm": len(norms), rotates: 1} | dict.fromkeys(mlp_ops, 1)
    if rope_op == "partial_rope":
        want["rope"] = 1  # partial_rope's torch path rotates through rope's
    assert calls == want


def _materialized_like(m: torch.nn.Module) -> torch.nn.Module:
    """A bf16 copy of a patched norm with random weights around its neutral value (the patch goes along)."""
    import copy

    m16 = copy.deepcopy(m).bfloat16()
    with torch.no_grad():
        neutral = 0.0 if type(m).__name__.startswith("Gemma") else 1.0
        m16.weight.copy_(neutral + torch.randn(m16.weight.shape, generator=torch.Generator().manual_seed(4)) * 0.3)
    return m16


def _context(stack: HFStack) -> dict:
    """Block 0's context from the head (masks and rotary tables; the rotary buffers are real already)."""
    edges = stack.make_edges()
    _materialized(edges.embed_tokens, seed=5)
    batch = {"input_ids": torch.randint(3, 200, (2, SEQ), generator=torch.Generator().manual_seed(6)),
             "position_ids": torch.arange(SEQ).expand(2, SEQ)}
    with torch.no_grad():
        _, ctx = edges.head(batch)
    return stack.block_context(0, ctx)


def _global_relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    diff = sum(((a[k].double() - b[k].double()) ** 2).sum() for k in a)
    return (diff / sum((b[k].double() ** 2).sum() for k in b)).sqrt().item()


def two_steps(tmp_path, model_type) -> tuple[dict, dict]:
    """Two steps of a tiny model with kernels off, then on: each run's losses and masters."""
    save_tiny_model(tmp_path / "model", model_type)
    rows, labels = make_rows(seed=7, n=2 * MICRO)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    masters, losses = {}, {}
    for kernels in ("off", "on"):
        trainer = Trainer(slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl", grad_accum=1,
                                       steps=2, output_dir=tmp_path / kernels, **{"engine.kernels": kernels}),
                          progress=False)
        block = trainer.engine.slots.slots[0].module
        assert getattr(block.layer.post_attention_layernorm, "_slide_kernels_patched", False) == (kernels == "on")
        losses[kernels] = [trainer.step()["loss"] for _ in range(2)]
        trainer.engine.synchronize()
        masters[kernels] = {k: t.clone() for k, t in hf_tensors(trainer.engine.named_masters())}
        trainer.close()
    return losses, masters


@pytest.mark.filterwarnings("ignore:engine.kernels:UserWarning")  # a mixture's experts (tested above)
@pytest.mark.parametrize("model_type", ALL)
def test_kernels_on_equals_kernels_off_after_two_steps(tmp_path, model_type, hf_rope):
    losses, masters = two_steps(tmp_path, model_type)
    assert losses["on"] == pytest.approx(losses["off"], rel=1e-5)
    assert _global_relative(masters["on"], masters["off"]) < 1e-5


def interpreted_gemma3(tmp_path: str) -> None:
    """Run in a process with TRITON_INTERPRET=1 (it must be set before slide_kernels loads): two steps with the
    Triton kernels in the blocks against two without; prints the launches and the masters' distance."""
    _print_two_steps(tmp_path, "gemma3_text", {"rms_norm": ["rms_norm_forward"], "rope": ["rope_apply"],
                                               "geglu": ["geglu_forward"]})


def _print_two_steps(tmp_path: str, model_type: str, launchers: dict[str, list[str]]) -> None:
    """Two steps of `model_type` with the kernels against two without, each of `launchers` (op module -> its
    launchers) counted; prints the launches, the losses and the masters' distance."""
    launches = {name: 0 for names in launchers.values() for name in names}
    for op, names in launchers.items():
        module = importlib.import_module(f"slide_kernels.ops.{op}")
        for name in names:
            original = getattr(module, name)

            def counting(*args, _name=name, _fn=original, **kwargs):
                launches[_name] += 1
                return _fn(*args, **kwargs)

            setattr(module, name, counting)
    losses, masters = two_steps(pathlib.Path(tmp_path), model_type)
    print(json.dumps({"launches": launches, "losses": losses,
                      "distance": _global_relative(masters["on"], masters["off"])}))


def interpreted_olmoe(tmp_path: str) -> None:
    """As interpreted_gemma3, for OLMoE: moe_experts' Triton forward and backward in the blocks (turned on in the
    families table, whatever its switch says)."""
    from slide_train.models import families

    families.FUSED_EXPERTS = True
    _print_two_steps(tmp_path, "olmoe", {"moe_experts": ["moe_experts_forward", "moe_experts_backward"]})


def _interpreted(tmp_path, function: str) -> dict:
    """What `function` of this module prints, run in a process of its own under Triton's interpreter."""
    here = pathlib.Path(__file__).parent
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(here), os.environ.get("PYTHONPATH")) if p)}
    code = f"import test_kernels_in_blocks as t; t.{function}({str(tmp_path)!r})"
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, cwd=here, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # about 30 s on 2 cores
def test_triton_experts_in_the_engine_match_kernels_off(tmp_path):
    """OLMoE's experts through moe_experts' kernels, in Triton's interpreter (the router and the load-balancing
    loss transformers' own): two steps give the kernels-off run's losses and masters (fp32, 1e-5)."""
    result = _interpreted(tmp_path, "interpreted_olmoe")
    layers, steps = 3, 2  # every sparse layer of every step, forward (and the recompute) and backward
    assert result["launches"]["moe_experts_forward"] >= steps * layers
    assert result["launches"]["moe_experts_backward"] >= steps * layers
    assert result["losses"]["on"] == pytest.approx(result["losses"]["off"], rel=1e-5)
    assert result["distance"] < 1e-5


def test_triton_kernels_in_the_engine_match_kernels_off(tmp_path):
    """Gemma 3 (GeGLU, 1 + weight norms with q/k norms and post-norms, local and global rotary tables): the
    kernels themselves, in Triton's interpreter, give the kernels-off run's losses and masters."""
    result = _interpreted(tmp_path, "interpreted_gemma3")
    # Every layer of every step ran each kernel (its forward at least; the engine's recompute runs more).
    layers, norms_per_layer, steps = 4, 6, 2
    launches = result["launches"]
    assert launches["rms_norm_forward"] >= steps * layers * norms_per_layer + steps  # and the final norm
    assert launches["geglu_forward"] >= steps * layers and launches["rope_apply"] >= steps * layers
    on, off = result["losses"]["on"], result["losses"]["off"]
    assert on == pytest.approx(off, rel=1e-5)
    assert result["distance"] < 1e-5
