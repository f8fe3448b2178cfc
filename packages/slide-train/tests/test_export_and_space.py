"""An export holds what a user loads from the base model besides its weights (generation config, tokenizer, chat
template), and the disk checks ask for what checkpoints and exports really take."""

from __future__ import annotations

import json
import os
import pathlib
import random
import re
import shutil

import pytest
import torch
import transformers
from conftest import save_tiny_model
from safetensors.torch import load_file, save_file

import slide_train.launch as launch_module
import slide_train.outputs as outputs_module
import slide_train.space as space
from slide_train.checkpoint import list_checkpoints, verify
from slide_train.cli import main
from slide_train.config import load_config
from slide_train.errors import DiskFullError
from slide_train.trainer import Trainer

TINY = ["--seq_len=32", "--micro_batch_size=2", "--grad_accum=1"]
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
WEIGHTS_AND_CONFIG = {"config.json", "model.safetensors"}


def base_model(directory: pathlib.Path, template: str) -> pathlib.Path:
    """A tiny instruct-like model: stop tokens and sampling defaults in generation_config.json, and its chat
    template where `template` says (tokenizer_config.json, chat_template.jinja, or the processors' legacy
    chat_template.json), with a second, named template in additional_chat_templates/."""
    save_tiny_model(directory, "llama")
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0, do_sample=True,
                                  temperature=0.6, top_p=0.9, max_new_tokens=77).save_pretrained(directory)
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    if template == "tokenizer_config":
        config = json.loads((directory / "tokenizer_config.json").read_text())
        config["chat_template"] = TEMPLATE
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    elif template == "jinja":
        (directory / "chat_template.jinja").write_text(TEMPLATE)
        (directory / "additional_chat_templates").mkdir()
        (directory / "additional_chat_templates" / "tool_use.jinja").write_text("{{ 'tools' }}" + TEMPLATE)
    else:
        (directory / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}, indent=2))
    return directory


def assert_holds_the_base_files(export: pathlib.Path, base: pathlib.Path) -> None:
    """Every file of the base other than its weights and config is in the export, byte for byte; the
    generation config and the tokenizer (chat templates included) load the same."""
    for path in base.rglob("*"):
        name = path.relative_to(base).as_posix()
        if path.is_file() and name not in WEIGHTS_AND_CONFIG:
            assert (export / name).read_bytes() == path.read_bytes(), name
    assert (transformers.GenerationConfig.from_pretrained(export).to_dict()
            == transformers.GenerationConfig.from_pretrained(base).to_dict())
    assert transformers.GenerationConfig.from_pretrained(export).eos_token_id == [2, 3]
    ours, theirs = transformers.AutoTokenizer.from_pretrained(export), transformers.AutoTokenizer.from_pretrained(base)
    assert ours.chat_template == theirs.chat_template
    assert ours("Hello, world")["input_ids"] == theirs("Hello, world")["input_ids"]


@pytest.mark.parametrize("template", ["tokenizer_config", "jinja", "json"])
def test_an_export_keeps_the_generation_config_tokenizer_and_chat_template(tmp_path, template):
    base = base_model(tmp_path / "base", template)
    if template != "json":  # (AutoTokenizer reads chat_template.json no more: the file itself is checked)
        assert transformers.AutoTokenizer.from_pretrained(base).chat_template is not None
    run = tmp_path / "run"
    Trainer(load_config(None, [*TINY, f"--model={base}", f"--output_dir={run}", "--steps=1"]), progress=False).fit()
    assert_holds_the_base_files(run / "export", base)
    model = transformers.AutoModelForCausalLM.from_pretrained(run / "export")
    assert model.generation_config.temperature == 0.6 and model.generation_config.eos_token_id == [2, 3]
    # `slide-train export` later, after the base model has gone: from the run's own copy of those files
    shutil.move(base, tmp_path / "moved")
    assert main(["export", str(run), "--out", str(tmp_path / "later")]) == 0
    assert_holds_the_base_files(tmp_path / "later", tmp_path / "moved")
    # Nothing but those files and the export's own: the tokenizer's save_pretrained wrote none of its extras.
    expected = {p.relative_to(tmp_path / "moved").as_posix() for p in (tmp_path / "moved").rglob("*") if p.is_file()}
    written = {p.relative_to(tmp_path / "later").as_posix() for p in (tmp_path / "later").rglob("*") if p.is_file()}
    assert written == expected | {".slide-export"}


def test_a_preset_export_has_its_tokenizer_and_no_generation_config(tmp_path):
    run = tmp_path / "run"
    Trainer(load_config(None, [*TINY, f"--output_dir={run}", "--steps=1"]), progress=False).fit()
    assert not (run / "export" / "generation_config.json").exists()
    assert transformers.AutoTokenizer.from_pretrained(run / "export").encode("cat")


def test_the_safetensors_size_is_the_size_the_library_writes(tmp_path):
    rng = random.Random(0)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int64, torch.bool, torch.int8]
    for trial in range(200):
        tensors = {"".join(rng.choice("ab.9_é") for _ in range(rng.randint(1, 20))):
                   torch.zeros([rng.randint(0, 300) for _ in range(rng.randint(0, 3))], dtype=rng.choice(dtypes))
                   for _ in range(rng.randint(1, 9))}
        metadata = rng.choice([None, {}, {"format": "pt"}])
        save_file(tensors, tmp_path / "t.safetensors", metadata=metadata)
        assert space.safetensors_bytes([(k, v.dtype, v.shape) for k, v in tensors.items()], metadata) == \
            os.path.getsize(tmp_path / "t.safetensors"), trial


def _bytes(*folders: pathlib.Path) -> int:
    return sum(p.stat().st_size for folder in folders for p in folder.rglob("*") if p.is_file())


def _allowance(nbytes: int) -> int:
    return max(nbytes // 100, 64 << 10)


def test_the_disk_check_asks_for_what_the_run_writes(tmp_path, monkeypatch):
    """A run with checkpoints and an export measures what they take; a disk just that big (plus at most
    max(1%, 64 KiB)) lets the same run go ahead and finish, one byte less is refused before training."""
    base = base_model(tmp_path / "base", "jinja")
    args = [*TINY, f"--model={base}", "--steps=2", "--checkpoint.keep=1", "--export_dtype=bf16"]

    def written(run: pathlib.Path) -> int:
        return _bytes(run / "checkpoints", run / "export")

    first = tmp_path / "run1"
    Trainer(load_config(None, [*args, f"--output_dir={first}"]), progress=False).fit()
    need = written(first)
    assert _bytes(first / "export") < 2 << 20  # a small export: the flat 16 MB once asked for was 5x too much

    # A disk of `size` bytes, the run's checkpoints and export its only files (the same folder length: the
    # checkpoint's trainer.json holds the path).
    second = tmp_path / "run2"
    size = {"bytes": 0}
    disk = lambda directory: size["bytes"] - written(second)  # noqa: E731
    monkeypatch.setattr(outputs_module, "free_bytes", disk)
    monkeypatch.setattr(space, "free_bytes", disk)
    loads, engine = [], launch_module.SlidingEngine
    monkeypatch.setattr(launch_module, "SlidingEngine", lambda *a, **k: loads.append(1) or engine(*a, **k))

    size["bytes"] = need - 1
    with pytest.raises(DiskFullError, match=r"checkpoint and export need about .*set export=false and export the "
                                            rf"last checkpoint .*`slide-train export {re.escape(str(second))} "
                                            r"--out DIR`"):
        Trainer(load_config(None, [*args, f"--output_dir={second}"]), progress=False)
    assert not loads  # refused before the weights were read
    size["bytes"] = need + _allowance(need)
    Trainer(load_config(None, [*args, f"--output_dir={second}"]), progress=False).fit()
    assert written(second) == need and [p.name for p in list_checkpoints(second / "checkpoints")] == ["step-2"]


def test_the_estimates_are_the_bytes_of_the_files(tmp_path):
    """Each figure is the bytes its files hold, exactly: the checkpoint's (of its trainer.json and RNG states;
    units resident with fp32 moments, the others bf16) and the export's, for a sharded export too."""
    import slide_train.checkpoint as ckpt
    import slide_train.export as export

    base = base_model(tmp_path / "base", "tokenizer_config")
    run = tmp_path / "run"
    trainer = Trainer(load_config(None, [*TINY, f"--model={base}", f"--output_dir={run}", "--steps=1",
                                         "--engine.states_dtype=bf16", "--engine.placement={resident: [edges]}"]),
                      progress=False)
    assert trainer.engine.resident == {0}
    trainer.fit()
    step = list_checkpoints(run / "checkpoints")[-1]
    rng = load_file(step / "rng.safetensors")
    size = ckpt.checkpoint_size([u.layout.numel for u in trainer.engine.units], trainer.engine.resident,
                                trainer.cfg.engine.states_dtype, json.loads((step / "trainer.json").read_text()),
                                1, rng)
    assert size.nbytes == _bytes(step)
    assert size.needed - size.nbytes <= _allowance(size.nbytes)
    layouts = ckpt.unit_layouts(trainer.model.stack())
    tensors = export.layout_tensors(layouts)
    for dtype in (torch.float32, torch.bfloat16):
        for shard_bytes in (export.SHARD_BYTES, 100_000):  # one file; shards and their index
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(export, "SHARD_BYTES", shard_bytes)
                out = export.export_hf(tmp_path / "out", trainer.model.hf_config, ckpt.read_masters(step, layouts),
                                       trainer.model.tokenizer, dtype, source=base)
                estimate = export.export_size(tensors, trainer.model.hf_config, dtype, trainer.model.tokenizer,
                                              base)
            assert estimate.nbytes == _bytes(out), (dtype, shard_bytes)
            assert (out / "model.safetensors.index.json").is_file() == (shard_bytes < export.SHARD_BYTES)
            assert transformers.AutoModelForCausalLM.from_pretrained(out).config.vocab_size > 0
    # a preset's tokenizer, written by its save_pretrained
    estimate = export.export_size(tensors, trainer.model.hf_config, torch.float32, trainer.model.tokenizer, None)
    out = export.export_hf(tmp_path / "preset", trainer.model.hf_config, ckpt.read_masters(step, layouts),
                           trainer.model.tokenizer, torch.float32)
    assert estimate.nbytes == _bytes(out)


def test_a_disk_short_only_for_the_export_keeps_the_checkpoint_and_says_how_to_finish(tmp_path, monkeypatch):
    """The disk fills during the run: the last checkpoint is written, the export does not fit. The checkpoint is
    intact, nothing of the export is left, and the command the message gives finishes the export elsewhere."""
    base = base_model(tmp_path / "base", "jinja")
    run = tmp_path / "run"
    monkeypatch.setattr(space, "free_bytes", lambda directory: 2000 if list_checkpoints(run / "checkpoints")
                        else 10**12)
    trainer = Trainer(load_config(None, [*TINY, f"--model={base}", f"--output_dir={run}", "--steps=2"]),
                      progress=False)
    step = run / "checkpoints" / "step-2"
    with pytest.raises(DiskFullError, match=rf"export to {re.escape(str(run / 'export'))} needs about .* MB, but only "
                                            rf"0.0 MB are free there: checkpoint {re.escape(str(step))} holds these "
                                            rf"weights and is intact: .*`slide-train export {re.escape(str(run))} "
                                            r"--out DIR`"):
        trainer.fit()
    verify(step)
    assert not (run / "export").exists() and not (run / "export.partial").exists()
    monkeypatch.setattr(space, "free_bytes", lambda directory: 10**12)
    assert main(["export", str(run), "--out", str(tmp_path / "elsewhere")]) == 0
    assert_holds_the_base_files(tmp_path / "elsewhere", base)
    embed = load_file(tmp_path / "elsewhere" / "model.safetensors")["model.embed_tokens.weight"]
    master = load_file(step / "edges.safetensors")["master"]  # the embedding comes first in the edges' master
    assert embed.dtype == torch.float32 and torch.equal(embed.flatten(), master[: embed.numel()])
