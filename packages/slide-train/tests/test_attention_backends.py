"""The attention backends: each computes HF's eager attention (windows, soft-cap, documents, padding) in float64
where it runs on the CPU, flash-attn-4's arguments say the same pairs as the dense mask, the choice follows what
a layer needs, and FlexAttention's compiled uses never fall back to the kernel that materializes the scores."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.models.gemma2 import modeling_gemma2

from slide_train.models import attention, backends

SEQ, HEADS, KV_HEADS, DIM = 40, 4, 2, 8
CASES = [  # (window, softcap, documents)
    (None, None, False), (6, None, False), (None, 5.0, False), (6, 5.0, True), (None, None, True), (None, 5.0, True)]


def documents(seq: int = SEQ) -> torch.Tensor:
    """Two rows of documents (ids in order along the row), each ending in padding (-1)."""
    a = ([0] * 11 + [1] * 17 + [2] * 7 + [3] * seq)[:seq - 5] + [-1] * 5
    b = ([0] * 3 + [1] * 30 + [2] * seq)[:seq - 7] + [-1] * 7
    return torch.tensor([a, b])


def module():
    """What HF's eager attention reads of its module, as a module of Gemma 2's (whose eager path the eager
    backend looks up by the module's own family)."""
    attn = types.new_class("Attention")()
    attn.__class__.__module__ = modeling_gemma2.__name__
    attn.num_key_value_groups, attn.training = HEADS // KV_HEADS, False
    return attn


def reference(q, k, v, window, softcap, docs, scale):
    """Float64 attention from first principles: each query's scores over the keys its rule allows (causal, inside
    the window, its own document; a padding position itself alone), soft-capped, softmax, times the values."""
    seq = q.shape[2]
    pos = torch.arange(seq)
    allowed = (pos[:, None] >= pos[None, :]).expand(q.shape[0], seq, seq).clone()
    if window is not None:
        allowed &= pos[:, None] - pos[None, :] < window
    if docs is not None:
        same = docs[:, :, None] == docs[:, None, :]
        alone = (docs[:, :, None] < 0) & (pos[:, None] == pos[None, :])
        allowed &= (same & (docs[:, :, None] >= 0)) | alone
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, 1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    probs = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
    return (probs @ v).transpose(1, 2)


def test_hf_eager_attention_is_the_reference():
    """HF's (Gemma 2's) eager attention with the dense additive mask computes the reference's pairs (to its
    float32 softmax), so the backends below meet HF's semantics."""
    q, k, v = inputs()
    for window, softcap, docs in CASES:
        ids = documents() if docs else None
        mask = attention.additive_mask(attention.attention_mask(ids, window, SEQ, "cpu"), SEQ, torch.float64, "cpu")
        hf = modeling_gemma2.eager_attention_forward(module(), q, k, v, mask, scaling=DIM ** -0.5, softcap=softcap)[0]
        torch.testing.assert_close(hf, reference(q, k, v, window, softcap, ids, DIM ** -0.5), rtol=1e-5, atol=1e-6)


def inputs(batch: int = 2):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch, h, SEQ, DIM, generator=g, dtype=torch.float64) for h in (HEADS, KV_HEADS, KV_HEADS)]


@pytest.mark.parametrize("window, softcap, docs", CASES)
@pytest.mark.parametrize("name", ["sdpa", "eager", "flex"])
def test_each_backend_computes_the_reference_in_float64(name, window, softcap, docs):
    """On the CPU, through the backend's own prepare and attend (FlexAttention through its compiled wrapper with
    torch.compile's eager backend: the same block mask and score rule, densely), against the float64 reference;
    HF's eager path to its float32 softmax."""
    backend = backends.get(name)
    if name == "flex":
        backend = backends.Flex()
        backend.compiled = backends.CompiledFlex(backend="eager")
    needs = backends.Needs(DIM, window, softcap, docs)
    why = backends.get(name).why_not(needs, torch.device("cpu"), torch.float64)
    if name == "sdpa" and softcap is not None:
        assert why == "it has no soft-cap"
        return
    q, k, v = inputs()
    ids = documents() if docs else None
    prepared = backends.Prepared(backend, backend.prepare(ids, window, SEQ, torch.float64, q.device), window, docs)
    out, _ = attention.attend(module(), q, k, v, prepared, scaling=DIM ** -0.5, softcap=softcap)
    expected = reference(q, k, v, window, softcap, ids, DIM ** -0.5)
    tol = 1e-5 if name == "eager" else 1e-10  # (HF's eager softmax is float32)
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol / 10)


@pytest.mark.parametrize("window", [None, 6, 1])
def test_flash_attn_4s_arguments_allow_exactly_the_dense_masks_pairs(window):
    """flash-attn-4's variable-length sequences (`_boundaries`) with its causal left window (window - 1) allow
    exactly the (query, key) pairs of the dense mask, padding seeing only itself."""
    docs = documents()
    cu, longest = backends._boundaries(docs)
    flat = SEQ * docs.shape[0]
    sequence = torch.zeros(flat, dtype=torch.long)
    sequence[cu[1:-1].long()] = 1
    sequence = sequence.cumsum(0)
    pos = torch.arange(flat)
    allowed = (sequence[:, None] == sequence[None, :]) & (pos[:, None] >= pos[None, :])
    if window is not None:
        allowed &= pos[:, None] - pos[None, :] <= window - 1
    dense = attention.attention_mask(docs, window, SEQ, "cpu")
    for b in range(docs.shape[0]):
        rows = slice(b * SEQ, (b + 1) * SEQ)
        assert torch.equal(allowed[rows, rows], dense[b, 0])
    assert not allowed[:SEQ, SEQ:].any() and not allowed[SEQ:, :SEQ].any()
    assert longest == 30 and cu.dtype == torch.int32 and int(cu[-1]) == flat


def test_the_choice_follows_what_the_layer_needs():
    """On the CPU: plain layers run SDPA, soft-capped ones HF's eager path; FlexAttention and flash-attn-4 name why
    they cannot run there, and a planned backend that cannot compute a layer stops with that reason."""
    cpu = torch.device("cpu")
    assert backends.candidates(backends.Needs(64), cpu, torch.float32)[0] == "sdpa"
    assert backends.candidates(backends.Needs(64, window=8, documents=True), cpu, torch.float32)[0] == "sdpa"
    capped = backends.Needs(256, softcap=50.0)
    assert backends.candidates(capped, cpu, torch.float32) == ("eager",)
    why = backends.reasons(capped, cpu, torch.float32)
    assert why["sdpa"] == "it has no soft-cap" and "CUDA" in why["flex"] and "CUDA" in why["fa4"]
    needs = backends.layer_needs({"full_attention": None, "sliding_attention": 16}, 64, None, 16, False)
    assert needs["sliding_attention"].window is None  # a window no shorter than the rows is plain causal
    assert backends.layer_needs({"sliding_attention": 16}, 64, None, 17, False)["sliding_attention"].window == 16
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        backends.get("flash")


def _kernel(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False):
    """Stands in for flex_attention: reads what the real one reads (the block mask's tiles and rule, the score
    rule)."""
    keep = block_mask.mask_mod(*(torch.tensor(i) for i in (0, 0, 1, 0)))
    out = query * scale * keep + block_mask.kv_num_blocks.sum() * 0
    return score_mod(out, 0, 0, 0, 0) if score_mod is not None else out


class Counter:
    def __init__(self):
        self.compiles = 0

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        return gm.forward


def uses():
    """window x documents x grad mode x eval x three lengths, as a run with eval and packed rows meets them."""
    for seq in (24, 40, 56):
        for window in (None, 6):
            for docs in (False, True):
                for grad in (False, True, False):  # forward, recompute, eval
                    yield seq, window, docs, grad


def run_uses(attend):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    for seq, window, docs, grad in uses():
        q = torch.randn(1, 2, seq, 8, generator=g, requires_grad=grad)
        ids = documents(seq)[:1] if docs else None
        mask = attention.block_mask(ids, window, seq, "cpu")
        with torch.set_grad_enabled(grad):
            attend((window, docs, 5.0), q, q, q, backends._soft_cap(5.0), mask, 0.5, False)


def test_flex_uses_never_reach_the_eager_kernel():
    """Through the real wrapper with a counting backend: every use above compiles within its own
    limit (at most twice: static, then dynamic lengths), so none falls back to the eager kernel; the same uses
    through one static compiled function (the wrapper this replaces) run past the limit, which the guard turns
    into an error, so this test would catch it."""
    counter = Counter()
    wrapper = backends.CompiledFlex(kernel=_kernel, backend=counter)
    run_uses(wrapper)
    assert len(wrapper.entries) == 8  # window x documents x grad mode
    assert counter.compiles <= 2 * len(wrapper.entries)

    single = torch.compile(_kernel, backend=Counter(), dynamic=False)

    def one_function(use, q, k, v, score_mod, block_mask, scale, gqa):
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            return single(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa)

    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        run_uses(one_function)


def test_a_use_past_its_limit_stops_with_a_clear_error():
    """Should a use recompile past the limit anyway, the step stops naming the limit, never the eager path."""
    wrapper = backends.CompiledFlex(kernel=_kernel, backend=Counter())
    torch._dynamo.reset()
    limits = torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False)
    with limits, pytest.raises(RuntimeError, match="recompiled past torch._dynamo's limit"):
        for seq in (24, 40):
            q = torch.randn(1, 2, seq, 8)
            wrapper((None, False, None), q, q, q, None, attention.block_mask(None, None, seq, "cpu"), 0.5, False)


def _bf16_case(window, softcap, docs, seq=1024, dim=256):
    """bf16 inputs on CUDA at head_dim 256 ([B, H, S, D] views of [B, S, H, D], as transformers hands them over),
    the gradient of the output, and each backend's prepared attention."""
    g = torch.Generator(device="cuda").manual_seed(0)
    leaves = [torch.randn(1, seq, h, dim, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
              for h in (HEADS, KV_HEADS, KV_HEADS)]
    grad = torch.randn(1, seq, HEADS, dim, generator=g, device="cuda", dtype=torch.bfloat16)
    ids = None
    if docs:
        ids = torch.zeros(1, seq, dtype=torch.long, device="cuda")
        ids[0, seq // 3:] = 1
        ids[0, seq - 40:] = -1
    return leaves, grad, ids


def _grads(run, leaves, grad):
    for t in leaves:
        t.grad = None
    out = run(*(t.transpose(1, 2) for t in leaves))
    out.backward(grad)
    got = [out.detach().float()] + [t.grad.float() for t in leaves]
    for t in leaves:
        t.grad = None
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("window, softcap, docs", [(None, 50.0, False), (256, 50.0, False), (None, 50.0, True),
                                                    (None, None, False)])
def test_on_the_gpu_each_backend_is_within_twice_hf_eager_bf16s_error(window, softcap, docs):
    """Each backend that runs here: out, dq, dk and dv in bf16 against an fp32 reference, within twice the error
    of HF's eager attention in bf16 (flash-attn-4 where it is installed; its absence is said, not skipped)."""
    if not torch.cuda.is_available():
        pytest.fail("this test needs a CUDA device: run it with a CUDA GPU (it is marked `gpu`)")
    leaves, grad, ids = _bf16_case(window, softcap, docs)
    seq, dim = leaves[0].shape[1], leaves[0].shape[-1]
    scale = dim ** -0.5

    def dense(dtype):
        def run(q, k, v):
            pos_ids = ids.cpu() if ids is not None else None
            out = reference_on(q.to(dtype), k.to(dtype), v.to(dtype), window, softcap, pos_ids, scale)
            return out
        return run

    ref = _grads(dense(torch.float32), leaves, grad)
    eager = _grads(dense(torch.bfloat16), leaves, grad)
    needs = backends.Needs(dim, window, softcap, docs)
    ran = []
    for name in backends.candidates(needs, torch.device("cuda"), torch.bfloat16):
        backend = backends.get(name)
        prepared = backends.prepare(backend, ids, window, seq, torch.bfloat16, torch.device("cuda"))
        got = _grads(lambda q, k, v, prepared=prepared: attention.attend(
            module(), q, k, v, prepared, scaling=scale, softcap=softcap)[0], leaves, grad)
        for what, g, r, e in zip(("out", "dq", "dk", "dv"), got, ref, eager):
            error, own = float((g - r).norm() / r.norm()), float((e - r).norm() / r.norm())
            print(f"{name} {what}: {error:.2e} (eager bf16 {own:.2e})")
            assert error <= 2 * own, f"{name} {what}: {error:.2e} against eager bf16's {own:.2e}"
        ran.append(name)
    print("ran:", ran, "why not:", backends.reasons(needs, torch.device("cuda"), torch.bfloat16))
    assert "flex" in ran


def reference_on(q, k, v, window, softcap, docs, scale):
    """The reference's arithmetic in the inputs' dtype (on their device): fp32 is the reference, bf16 HF eager's
    own rounding (scores and softmax output in bf16, the softmax in fp32)."""
    seq = q.shape[2]
    pos = torch.arange(seq, device=q.device)
    allowed = (pos[:, None] >= pos[None, :])[None].clone()
    if window is not None:
        allowed &= pos[:, None] - pos[None, :] < window
    if docs is not None:
        d = docs.to(q.device)
        allowed &= ((d[:, :, None] == d[:, None, :]) & (d[:, :, None] >= 0)) | (
            (d[:, :, None] < 0) & (pos[:, None] == pos[None, :]))
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed[:, None], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (probs @ v).transpose(1, 2)


@pytest.mark.gpu
def test_on_the_gpu_gemma2_at_three_lengths_with_eval_and_documents_never_runs_eager_attention(tmp_path):
    """In one process, after Llama and Mistral: Gemma 2 (soft-capped, local and global layers) trains a step and
    evaluates at three lengths with packed documents; FlexAttention's uncompiled kernel (which materializes the
    scores, and warns "without torch.compile") never runs, and each layer type ran a fused backend."""
    import warnings

    from conftest import save_tiny_model

    from slide_train.config import load_config
    from slide_train.trainer import Trainer

    if not torch.cuda.is_available():
        pytest.fail("this test needs a CUDA device: run it with a CUDA GPU (it is marked `gpu`)")
    ran = set()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for family, lengths in (("llama", (128,)), ("mistral", (128,)), ("gemma2", (128, 192, 256))):
            save_tiny_model(tmp_path / family, family)
            for seq in lengths:
                cfg = load_config(None, [
                    f"--model={tmp_path / family}", f"--seq_len={seq}", "--micro_batch_size=2", "--grad_accum=2",
                    "--steps=1", "--data.pack=true", "--data.eval_fraction=0.2", "--data.eval_batches=2",
                    "--engine.device=cuda", f"--output_dir={tmp_path / f'{family}-{seq}'}", "--export=false"])
                trainer = Trainer(cfg, progress=False)
                loss = trainer.step()["loss"]
                evaluated = trainer.evaluate()["eval_loss"]
                assert loss == loss and evaluated == evaluated  # (finite: not NaN)
                ran |= {(family, key[0], b.name) for key, b in trainer.engine.edges._chosen.items()}
                trainer.close()
    eager = [str(w.message) for w in caught if "without torch.compile" in str(w.message)]
    assert not eager, eager
    print("backends:", sorted(ran))
    assert all(name in ("flex", "fa4") for family, kind, name in ran if family == "gemma2")
