"""slide-train's engine against a plain PyTorch loop: an HF model, torch.optim.AdamW, clip_grad_norm_."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from conftest import save_tiny_model, write_token_rows

from slide_scheduler.plan import planner as planner_module
from slide_train.config import load_config
from slide_train.export import hf_tensors
from slide_train.trainer import Trainer

SEQ, MICRO, ACCUM, STEPS = 24, 2, 2, 3
# eps 1e-6, not torch's 1e-8: where a parameter's gradient is near zero (a token seen once), AdamW turns its
# rounding noise into an update of lr * noise / eps, so at 1e-8 one element of the embedding decided whether our
# fp32 run or torch's lay nearer the float64 one, and which won depended on the CPU's vector width (AVX2 or
# scalar kernels). At 1e-6 the comparison sees the engine: an lr 1e-4 off still fails every case.
LR, BETAS, EPS, WD, CLIP = 3e-3, (0.9, 0.95), 1e-6, 0.1, 0.05


def make_rows(seed: int, n: int) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(3, 259, (n, SEQ), generator=g)
    labels = rows.clone()
    labels[:, : SEQ // 3] = -100  # a prompt without loss, so micro-batches carry different token counts
    labels[1::3, : SEQ // 2] = -100
    return rows.tolist(), labels.tolist()


def reference_run(model, rows, labels, dtype=torch.float32, device="cpu", autocast=None, clip=None):
    """The plain loop: mean loss over all label tokens of the step, AdamW, global-norm clipping at `clip` (by
    default CLIP as it is when called: some tests set it); on `device`, under autocast to `autocast` where given
    (the weights stay `dtype`)."""
    clip = CLIP if clip is None else clip
    model = copy.deepcopy(model).to(device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    ids, lab = torch.tensor(rows, device=device), torch.tensor(labels, device=device)
    losses, norms = [], []
    per_step = MICRO * ACCUM
    for step in range(STEPS):
        chunk = slice(step * per_step, (step + 1) * per_step)
        step_ids, step_lab = ids[chunk], lab[chunk]
        n_items = int((step_lab[:, 1:] != -100).sum())
        opt.zero_grad()
        total = 0.0
        for m in range(ACCUM):
            mb = slice(m * MICRO, (m + 1) * MICRO)
            with torch.autocast(torch.device(device).type, dtype=autocast or dtype, enabled=autocast is not None):
                out = model(input_ids=step_ids[mb], labels=step_lab[mb], num_items_in_batch=n_items)
            out.loss.backward()
            total += out.loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        losses.append(total)
    return model, losses, norms


# bf16 compute's tolerance per family, against the fp32 loop: each step's loss (relative), and the trained weights'
# distance from fp32's relative to fp32's update. HF's own autocast run stays under the same bounds.
BF16_TOLERANCE = {
    "llama": (2e-3, 0.1), "qwen2": (2e-3, 0.1), "qwen3": (2e-3, 0.1), "mistral": (2e-3, 0.1),
    "phi3": (2e-3, 0.1), "granite": (2e-3, 0.1), "gemma": (2e-3, 0.1), "gemma2": (2e-3, 0.1),
    "olmo2": (2e-3, 0.15), "olmo3": (2e-3, 0.15), "gemma3_text": (3e-3, 0.2),
    "qwen3_moe": (2e-3, 0.15), "mixtral": (2e-3, 0.15), "olmoe": (2e-3, 0.15),
}


def assert_bf16_tracks_fp32(tmp_path, family: str, device: str) -> None:
    errors = bf16_errors(tmp_path, family, device)
    print(f"{family} on {device}: " + "; ".join(
        f"{k}: loss {max(v[0]):.2e}, weights {v[1]:.4f}" for k, v in errors.items()))
    loss_tol, weight_tol = BF16_TOLERANCE[family]
    for who, (losses, weights) in errors.items():
        assert max(losses) < loss_tol and 0 < weights < weight_tol, (who, errors)  # (0: not bf16 at all)


def bf16_errors(tmp_path, family: str, device: str) -> dict[str, tuple[list[float], float]]:
    """Three clipped steps of a tiny `family` model in bf16 compute on `device`, ours (fp32 masters) and HF's
    model trained there with HF's loss under bf16 autocast (fp32 weights), each measured against the same HF
    loop in fp32: per step the loss's relative error, and the trained weights' global distance from fp32's
    relative to the fp32 update (all tensors as one vector)."""
    model = save_tiny_model(tmp_path / "model", family)
    rows, labels = make_rows(seed=1, n=STEPS * MICRO * ACCUM)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    trainer = Trainer(slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl",
                                   **{"engine.device": device, "engine.compute_dtype": "bf16"}), progress=False)
    assert trainer.memory_plan.placement.compute_bytes == 2
    ours = [trainer.step()["loss"] for _ in range(STEPS)]
    trainer.engine.synchronize()
    masters = dict(hf_tensors(trainer.engine.named_masters()))
    trainer.close()
    truth, truth_losses, _ = reference_run(model, rows, labels, device=device)
    hf, hf_losses, _ = reference_run(model, rows, labels, device=device, autocast=torch.bfloat16)
    start, want, got_hf = model.state_dict(), truth.state_dict(), hf.state_dict()

    def distance(weights) -> float:
        off = sum(((weights[n].double().cpu() - want[n].double().cpu()) ** 2).sum() for n in masters)
        update = sum(((want[n].double().cpu() - start[n].double()) ** 2).sum() for n in masters)
        return (off / update).sqrt().item()

    def loss_errors(losses) -> list[float]:
        return [abs(a - b) / b for a, b in zip(losses, truth_losses, strict=True)]

    return {"ours": (loss_errors(ours), distance(masters)), "hf": (loss_errors(hf_losses), distance(got_hf))}


def slide_config(tmp_path, model_dir, data_path, **extra):
    overrides = [
        f"--model={model_dir}", f"--data.path={data_path}", "--data.format=tokens", "--data.shuffle=false",
        "--data.pack=false", f"--seq_len={SEQ}", f"--micro_batch_size={MICRO}", f"--grad_accum={ACCUM}",
        f"--steps={STEPS}", f"--optimizer.lr={LR}", f"--optimizer.betas=[{BETAS[0]}, {BETAS[1]}]",
        f"--optimizer.eps={EPS}", f"--optimizer.weight_decay={WD}", f"--max_grad_norm={CLIP}",
        "--schedule.decay=constant", "--engine.device=cpu", f"--output_dir={tmp_path / 'run'}",
    ] + [f"--{k}={v}" for k, v in extra.items()]
    return load_config(None, overrides)


def compare(trainer, ref_model, ref64=None):
    """Our fp32 masters vs the plain fp32 loop: 1e-5 relative per tensor, or, where the two fp32 runs differ
    by more (different summation orders amplified by AdamW's normalization), no further from a float64 run of
    the same loop than torch's own fp32 run is (plus 50%)."""
    ref = ref_model.state_dict()
    exact = ref64.state_dict() if ref64 is not None else None
    for name, ours in hf_tensors(trainer.engine.named_masters()):
        theirs = ref[name]
        if name.endswith("k_proj.bias"):
            # Adding a constant to every key leaves softmax unchanged, so this gradient is exactly zero and
            # only rounding noise reaches AdamW, which amplifies it to about lr per step in either run.
            torch.testing.assert_close(ours, theirs, rtol=0, atol=3 * STEPS * LR)
            continue
        err = ((ours - theirs).norm() / theirs.norm()).item()
        if err < 1e-5:
            continue
        assert exact is not None, f"{name}: relative error {err:.2e} vs the fp32 loop"
        truth = exact[name].float()
        ours_err = (ours - truth).norm().item()
        torch_err = (theirs - truth).norm().item()
        assert ours_err <= 1.5 * torch_err, f"{name}: {ours_err:.2e} from float64, torch fp32 {torch_err:.2e}"


@pytest.mark.parametrize("window, offload", [(1, "host"), (2, "gpu"), (3, "host")])
def test_three_steps_match_plain_pytorch(tmp_path, family, window, offload):
    """Clipped: held host gradients over the activations' memory (activations on the host), or a buffer each
    (activations on the device; split updates)."""
    model = save_tiny_model(tmp_path / "model", family)
    rows, labels = make_rows(seed=1, n=STEPS * MICRO * ACCUM)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    cfg = slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl",
                       **{"engine.placement.window": window, "engine.activation_offload": offload})
    trainer = Trainer(cfg, progress=False)
    assert trainer.engine.placement.window == window
    assert (trainer.engine.homes.pool is None) == (offload == "gpu")
    records = [trainer.step() for _ in range(STEPS)]
    ref_model, ref_losses, ref_norms = reference_run(model, rows, labels)
    assert [r["loss"] for r in records] == pytest.approx(ref_losses, rel=1e-5)
    assert [r["grad_norm"] for r in records] == pytest.approx(ref_norms, rel=1e-5)
    assert all(r["grad_norm"] > CLIP for r in records), "clipping must be active in this test"
    compare(trainer, ref_model, reference_run(model, rows, labels, torch.float64)[0])


def test_gradients_sharing_the_activations_memory_match(tmp_path):
    """Clipped with the activations on the host, held gradients lie over the boundary activations' memory: the
    result is still the plain loop's, and the placement's pool is the bytes the engine allocates for it."""
    model = save_tiny_model(tmp_path / "model", "llama")
    rows, labels = make_rows(seed=5, n=STEPS * MICRO * ACCUM)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    trainer = Trainer(slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl"), progress=False)
    records = [trainer.step() for _ in range(STEPS)]
    assert all(r["grad_norm"] > CLIP for r in records)
    placement = trainer.memory_plan.placement
    assert placement.pooled and trainer.engine.homes.ring is None
    assert trainer.engine.homes.pool.nbytes == placement.tiers()["host"]["gradients + boundary activations"]
    ref_model, _, _ = reference_run(model, rows, labels)
    compare(trainer, ref_model, reference_run(model, rows, labels, torch.float64)[0])


def test_activation_offload_and_no_clipping_match(tmp_path):
    model = save_tiny_model(tmp_path / "model", "llama")
    rows, labels = make_rows(seed=2, n=STEPS * MICRO * ACCUM)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    for offload in ("gpu", "host"):
        cfg = slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl",
                           **{"engine.activation_offload": offload, "max_grad_norm": 1e9,
                              "output_dir": tmp_path / offload})
        trainer = Trainer(cfg, progress=False)
        for _ in range(STEPS):
            trainer.step()
        compare(trainer, unclipped_reference(model, rows, labels))


def unclipped_reference(model, rows, labels):
    """The plain loop's model after the same steps with clipping that never acts."""
    global CLIP
    saved, CLIP = CLIP, 1e9
    try:
        return reference_run(model, rows, labels)[0]
    finally:
        CLIP = saved


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_unclipped_updates_in_the_backward_at_the_steps_end_and_mixed_match(tmp_path, monkeypatch, share):
    """Without clipping the planner defers the first sliding blocks' host updates to the step's end and runs the
    others' during the backward; held to one share of deferred blocks (none, half, all), the weights are the
    plain loop's (whose clipping never acts)."""
    monkeypatch.setattr(planner_module, "DEFERRED_SHARES", (share,))
    # (the clipped run's placement, run unclipped, defers every host update: kept out to hold the share)
    monkeypatch.setattr(planner_module._Planning, "clipped_unclipped", lambda self, o: None)
    model = save_tiny_model(tmp_path / "model", "llama")
    rows, labels = make_rows(seed=2, n=STEPS * MICRO * ACCUM)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    trainer = Trainer(slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl", max_grad_norm="null"),
                      progress=False)
    p = trainer.engine.placement
    sliding = p.sliding_blocks
    assert not p.clips and p.deferred - {0} == set(sliding[:round(share * p.shapes.num_blocks)]) & p.deferred
    assert bool(p.deferred - {0}) == (share > 0) and (share < 1) == any(not p.waits(u) for u in sliding)
    for _ in range(STEPS):
        trainer.step()
    compare(trainer, unclipped_reference(model, rows, labels))


def test_export_loads_in_transformers_with_same_logits(tmp_path, family):
    save_tiny_model(tmp_path / "model", family)
    rows, labels = make_rows(seed=3, n=STEPS * MICRO * ACCUM)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    trainer = Trainer(slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl"), progress=False)
    for _ in range(STEPS):
        trainer.step()
    out = trainer.export(tmp_path / "export")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert loaded.config.model_type == family
    # The engine's own view of the model: masters loaded into a fresh HF model by name.
    state = dict(hf_tensors(trainer.engine.named_masters()))
    fresh = transformers.AutoModelForCausalLM.from_config(loaded.config).float()
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    fresh.tie_weights()
    ids = torch.tensor(rows[:2])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, fresh(ids).logits, rtol=1e-5, atol=1e-5)
        # ...and the engine's evaluation loss equals transformers' loss of the exported model.
        lab = torch.tensor(labels[:2])
        hf_loss = loaded(ids, labels=lab).loss.item()
    batch = {"input_ids": ids, "labels": lab, "position_ids": torch.arange(SEQ).expand(2, SEQ),
             "document_ids": torch.zeros(2, SEQ, dtype=torch.long)}
    from slide_train.batches import prepare

    micro = [prepare(batch)]
    n = int((micro[0]["targets"] != -100).sum())
    assert trainer.engine.evaluate(micro, normalizer=n) == pytest.approx(hf_loss, rel=1e-5)
    assert transformers.AutoTokenizer.from_pretrained(out).decode([104, 105]) != ""


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_kernels_in_the_blocks_match_plain_pytorch(tmp_path, family):
    """engine.kernels=on swaps slide-kernels' RMSNorm / RoPE / SwiGLU into every block (their torch path here)."""
    model = save_tiny_model(tmp_path / "model", family)
    rows, labels = make_rows(seed=5, n=STEPS * MICRO * ACCUM)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    trainer = Trainer(slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl",
                                   **{"engine.kernels": "on"}), progress=False)
    block = trainer.engine.slots.slots[0].module
    assert getattr(block.layer.input_layernorm, "_slide_kernels_patched", False)
    assert getattr(block.layer.mlp, "_slide_kernels_patched", False)
    for _ in range(STEPS):
        trainer.step()
    ref_model, _, _ = reference_run(model, rows, labels)
    compare(trainer, ref_model, reference_run(model, rows, labels, torch.float64)[0])


def test_bf16_states_opt_in_tracks_fp32_states_and_resumes(tmp_path):
    """bf16 AdamW states track fp32 ones; with the last blocks' states on disk (in bf16 there too) they give the
    in-memory bf16 run bit for bit, checkpoint the same states, and resume."""
    save_tiny_model(tmp_path / "model", "llama")
    rows, labels = make_rows(seed=6, n=STEPS * MICRO * ACCUM)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    runs, states, paths = {}, {}, {}
    for name, dtype, fraction in (("fp32", "fp32", 0.0), ("bf16", "bf16", 0.0), ("bf16-disk", "bf16", 0.5)):
        trainer = Trainer(slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl",
                                       **{"engine.states_dtype": dtype, "output_dir": tmp_path / name,
                                          "engine.nvme.fraction": fraction}), progress=False)
        assert len(trainer.engine.on_disk) == (2 if fraction else 0)
        runs[name] = [trainer.step()["loss"] for _ in range(STEPS)]
        paths[name] = trainer.save_checkpoint()
        trainer.engine.synchronize()
        states[name] = [trainer.engine.optimizer_state(u) for u in range(len(trainer.engine.units))]
        assert states[name][-1]["exp_avg"].dtype == getattr(torch, "bfloat16" if dtype == "bf16" else "float32")
        trainer.close()
    assert runs["bf16"][0] == runs["fp32"][0]  # same start; the states only matter from step 2 on
    assert runs["bf16"] == pytest.approx(runs["fp32"], rel=1e-3)
    assert runs["bf16-disk"] == runs["bf16"]
    for a, b in zip(states["bf16"], states["bf16-disk"]):
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    for name in ("bf16", "bf16-disk"):
        resumed = Trainer(slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl",
                                       **{"engine.states_dtype": "bf16", "output_dir": tmp_path / name,
                                          "engine.nvme.fraction": 0.5 if "disk" in name else 0.0,
                                          "resume": paths[name]}), progress=False)
        assert resumed.step_index == STEPS
        resumed.engine.synchronize()
        got = [resumed.engine.optimizer_state(u) for u in range(len(resumed.engine.units))]
        assert all(a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a) for a, b in zip(got, states[name]))
        resumed.close()


def test_a_run_with_every_master_on_disk_exports_the_in_memory_runs_weights(tmp_path):
    """Masters on disk reach the export through their files, mapped, not copied in: the exported weights are the
    in-memory run's, bit for bit, and so is a checkpoint's masters."""
    from safetensors.torch import load_file

    save_tiny_model(tmp_path / "model", "llama")
    rows, labels = make_rows(seed=7, n=STEPS * MICRO * ACCUM)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    exported, saved = {}, {}
    for name, fraction in (("ram", 0.0), ("disk", 1.0)):
        trainer = Trainer(slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl",
                                       **{"output_dir": tmp_path / name, "engine.nvme.fraction": fraction}),
                          progress=False)
        assert bool(trainer.memory_plan.placement.masters_on_disk) == bool(fraction)
        for _ in range(STEPS):
            trainer.step()
        saved[name] = load_file(trainer.save_checkpoint() / "block-001.safetensors")
        exported[name] = load_file(trainer.export() / "model.safetensors")
        trainer.close()
    assert exported["ram"].keys() == exported["disk"].keys()
    assert all(torch.equal(exported["ram"][k], exported["disk"][k]) for k in exported["ram"])
    assert all(torch.equal(saved["ram"][k], saved["disk"][k]) for k in saved["ram"])


def test_sliding_window_attention_longer_than_the_window_matches_hf(tmp_path):
    """Mistral with seq_len > sliding_window: the engine's explicit windowed mask gives HF's own loss."""
    torch.manual_seed(0)
    from conftest import tiny_config

    from slide_train.data import builtin_tokenizer

    config = tiny_config("mistral")
    config.sliding_window = 7
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(tmp_path / "m")
    builtin_tokenizer().save_pretrained(tmp_path / "m")
    rows, labels = make_rows(seed=7, n=STEPS * MICRO * ACCUM)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    trainer = Trainer(slide_config(tmp_path, tmp_path / "m", tmp_path / "data.jsonl"), progress=False)
    ids, lab = torch.tensor(rows[:2]), torch.tensor(labels[:2])
    from slide_train.batches import prepare

    micro = [prepare({"input_ids": ids, "labels": lab, "position_ids": torch.arange(SEQ).expand(2, SEQ),
                      "document_ids": torch.zeros(2, SEQ, dtype=torch.long)})]
    n = int((micro[0]["targets"] != -100).sum())
    with torch.no_grad():
        windowed = model(ids, labels=lab).loss.item()
        model.config.sliding_window = None
        full = model(ids, labels=lab).loss.item()
    assert abs(windowed - full) > 1e-4, "the window must matter at this length for the test to mean anything"
    assert trainer.engine.evaluate(micro, normalizer=n) == pytest.approx(windowed, rel=1e-5)


@pytest.mark.parametrize("clip", [CLIP, None])
def test_edges_updated_on_the_device_with_their_tail_apart_match(tmp_path, clip, monkeypatch):
    """The adapter declares the final norm and the untied lm head tail-only: with the edges updated on the
    device, that part updates apart (during backward without clipping); the result is the plain loop's."""
    model = save_tiny_model(tmp_path / "model", "llama")
    assert not model.config.tie_word_embeddings
    rows, labels = make_rows(seed=3, n=STEPS * MICRO * ACCUM)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    cfg = slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl",
                       **{"engine.placement.device_update_share": 1.0, "max_grad_norm": clip if clip else "null"})
    trainer = Trainer(cfg, progress=False)
    engine = trainer.engine
    norm = next(e for e in engine.edge_slot.layout.entries if e.name == "norm.weight")
    assert [engine.optimizer.units[0].ranges[k][0] for k in engine.stream.tail] == [norm.offset]
    records = [trainer.step() for _ in range(STEPS)]
    assert all(r["grad_norm"] > CLIP for r in records)  # clipping acts when on
    monkeypatch.setitem(globals(), "CLIP", clip or 1e9)  # the reference loop's clipping
    ref_model, _, _ = reference_run(model, rows, labels)
    compare(trainer, ref_model, reference_run(model, rows, labels, torch.float64)[0])


@pytest.mark.parametrize("folder", ["default", "own"])
def test_activations_on_disk_match_plain_pytorch_and_leave_no_files(tmp_path, folder):
    """engine.activation_offload=nvme: the boundary activations pass through files, and the run is still the
    plain loop's (and bit for bit the run with them in host memory); the plan counts them on disk, and the end
    of the run removes the files (and the default folder, not one of the user's)."""
    model = save_tiny_model(tmp_path / "model", "llama")
    rows, labels = make_rows(seed=3, n=STEPS * MICRO * ACCUM)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    own = tmp_path / "scratch"
    own.mkdir()  # (a folder the user names exists: the run never makes it)
    extra = {"engine.activation_offload": "disk"} | ({"engine.nvme.dir": str(own)} if folder == "own" else {})
    results = []
    for options in ({}, extra):
        cfg = slide_config(tmp_path / str(len(results)), tmp_path / "model", tmp_path / "data.jsonl", **options)
        trainer = Trainer(cfg, progress=False)
        records = [trainer.step() for _ in range(STEPS)]
        results.append(([r["loss"] for r in records], dict(hf_tensors(trainer.engine.named_masters())), trainer))
    (ref_losses, ref, _), (losses, got, trainer) = results
    assert trainer.engine.activations.disk is not None and trainer.engine.homes.pool is None
    assert trainer.memory_plan.placement.tiers()["disk"]["boundary activations"] > 0
    assert "boundary activations" in trainer.plan()
    assert losses == ref_losses and all(got[name].equal(t) for name, t in ref.items())
    ref_model, _, _ = reference_run(model, rows, labels)
    compare(trainer, ref_model, reference_run(model, rows, labels, torch.float64)[0])
    where = own if folder == "own" else tmp_path / "1" / "run" / "nvme"
    assert any((where / "activations").rglob("*.bin"))
    trainer.close()
    assert not any(where.rglob("*.bin")) and where.exists() == (folder == "own")


@pytest.mark.parametrize("pause", [True, False])
def test_speculation_matches_plain_pytorch_and_logs_what_it_did(tmp_path, monkeypatch, pause):
    """engine.placement.speculate: clipped host updates also run during backward; steps whose clipping acts
    discard that, the others keep it, and the step after one whose clipping acted does not speculate (unless
    `speculation_pause` is off). The result is the plain loop's either way, and metrics.jsonl says which."""
    from slide_train.metrics import read_metrics

    model = save_tiny_model(tmp_path / "model", "llama")
    rows, labels = make_rows(seed=1, n=STEPS * MICRO * ACCUM)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    monkeypatch.setitem(globals(), "CLIP", 1e9)
    _, _, norms = reference_run(model, rows, labels)
    limit = (sorted(norms)[1] + sorted(norms)[2]) / 2  # the loop's clipping acts on some steps, not others
    monkeypatch.setitem(globals(), "CLIP", limit)
    ref_model, ref_losses, ref_norms = reference_run(model, rows, labels)
    assert min(ref_norms) < limit < max(ref_norms)
    trainer = Trainer(slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl",
                                   **{"engine.placement.speculate": "true", "max_grad_norm": limit,
                                      "engine.placement.speculation_pause": str(pause).lower()}), progress=False)
    assert trainer.engine.placement.speculated and trainer.engine.placement.speculation_pause == pause
    records = [trainer.step() for _ in range(STEPS)]
    acted = [n > limit for n in ref_norms]
    expected = ["off" if pause and t and acted[t - 1] else "discarded" if a else "held" for t, a in enumerate(acted)]
    assert [r["speculation"] for r in records] == expected and {"held", "discarded"} <= set(expected)
    assert ("off" in expected) == pause  # (a step after one whose clipping acted: sat out or speculated)
    assert [r["loss"] for r in records] == pytest.approx(ref_losses, rel=1e-5)
    compare(trainer, ref_model, reference_run(model, rows, labels, torch.float64)[0])
    trainer.log.close()
    logged = [r["speculation"] for r in read_metrics(trainer.run_dir / "metrics.jsonl") if "loss" in r]
    assert logged == [r["speculation"] for r in records]
