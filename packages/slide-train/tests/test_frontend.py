"""Front-end paths end to end through the engine: packing, chat fine-tunes, `slide-train data`, export."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import save_tiny_model, write_token_rows
from torch import nn

import slide_train.data.formats
import slide_train.models.loss
from slide_train.batches import prepare
from slide_train.cli import main
from slide_train.config import load_config
from slide_train.data import DataConfig, build_data
from slide_train.models.adapter import Edges
from slide_train.trainer import Trainer


def test_the_tail_runs_the_lm_head_only_on_tokens_with_a_target(monkeypatch):
    """`prepare` lists the tokens that have a target (a prompt's carry none); the tail sends only those
    through the final norm and the lm head, and gets the loss and gradients of plain cross-entropy over every
    token's logits (float64)."""
    torch.manual_seed(0)
    hidden_size, vocab, seq = 16, 50, 12
    edges = Edges(nn.Embedding(vocab, hidden_size), None, nn.RMSNorm(hidden_size),
                  nn.Linear(hidden_size, vocab, bias=False), None).double()
    ids = torch.randint(0, vocab, (2, seq))
    labels = ids.clone()
    labels[:, :5] = -100
    labels[1, :9] = -100
    batch = prepare({"input_ids": ids, "labels": labels, "position_ids": torch.arange(seq).expand(2, seq),
                     "document_ids": torch.zeros(2, seq, dtype=torch.long)})
    kept = (batch["targets"].reshape(-1) != -100).nonzero().flatten()
    assert batch["loss_rows"].tolist() == kept.tolist() and 0 < len(kept) < 2 * seq
    rows_seen = []
    fused = slide_train.models.loss.linear_cross_entropy
    monkeypatch.setattr(slide_train.models.loss, "linear_cross_entropy",
                        lambda h, *args, **kwargs: rows_seen.append(h.shape[0]) or fused(h, *args, **kwargs))
    hidden = torch.randn(2, seq, hidden_size, dtype=torch.float64, requires_grad=True)

    def loss_and_grads(tail):
        edges.zero_grad()
        hidden.grad = None
        loss = tail()
        loss.backward()
        return [loss.detach(), hidden.grad, edges.lm_head.weight.grad, edges.norm.weight.grad]

    got = loss_and_grads(lambda: edges.tail(hidden, batch, normalizer=7.0))
    assert rows_seen == [len(kept)]
    want = loss_and_grads(lambda: F.cross_entropy(edges.lm_head(edges.norm(hidden)).reshape(-1, vocab),
                                                  batch["targets"].reshape(-1), reduction="sum") / 7.0)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    # Where nearly every token has a target (here all but each row's last), the tail takes them all as they are.
    long = torch.randint(0, vocab, (2, 64))
    assert "loss_rows" not in prepare({"input_ids": long, "labels": long,
                                       "position_ids": torch.arange(64).expand(2, 64),
                                       "document_ids": torch.zeros(2, 64, dtype=torch.long)})


def test_packed_rows_give_the_unpacked_loss_through_the_engine(tmp_path):
    """Attention never crosses a packed document boundary: the engine's summed loss over all documents is the
    same packed (several documents a row, document masks) as unpacked (one document a row, padding)."""
    save_tiny_model(tmp_path / "m", "llama")
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 259, (int(n),), generator=g).tolist() for n in torch.randint(5, 30, (12,), generator=g)]
    write_token_rows(tmp_path / "d.jsonl", docs, docs)  # (with labels: packed whole, as the unpacked rows hold them)
    trainer = Trainer(load_config(None, [f"--model={tmp_path / 'm'}", f"--data.path={tmp_path / 'd.jsonl'}",
                                         "--data.format=tokens", "--seq_len=64", "--micro_batch_size=2",
                                         "--engine.device=cpu", f"--output_dir={tmp_path / 'r'}"]), progress=False)

    def total_loss(pack: bool) -> tuple[float, int]:
        cfg = DataConfig(path=str(tmp_path / "d.jsonl"), format="tokens", shuffle=False, pack=pack)
        loader = build_data(cfg, None, 64, 2, seed=0).train
        micro = [prepare(loader.next_micro_batch()) for _ in range(-(-loader.rows_per_epoch // 2))]
        targets = sum(int((m["targets"] != -100).sum()) for m in micro)
        return trainer.engine.evaluate(micro, normalizer=1.0), targets

    (packed, n_packed), (unpacked, n_unpacked) = total_loss(True), total_loss(False)
    assert n_packed == n_unpacked == sum(len(d) - 1 for d in docs)
    assert packed == pytest.approx(unpacked, rel=1e-5)


def chat_rows(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        a, b = i % 7, (3 * i) % 5
        rows.append({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                  {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]})
    return rows


def test_chat_finetune_of_a_local_model_from_the_command_line(tmp_path, capsys, monkeypatch):
    save_tiny_model(tmp_path / "m", "qwen3")
    reads = []
    read_documents, read_rows = slide_train.data.formats.read_documents, slide_train.data.formats.read_rows
    monkeypatch.setattr(slide_train.data.formats, "read_documents", lambda *a: reads.append(a) or read_documents(*a))
    monkeypatch.setattr(slide_train.data.formats, "read_rows", lambda *a: reads.append(a) or read_rows(*a))
    with open(tmp_path / "chat.jsonl", "w") as f:
        for row in chat_rows(40):
            f.write(json.dumps(row) + "\n")
    cfg = tmp_path / "chat.yaml"
    cfg.write_text(f"model: {tmp_path / 'm'}\ndata: {{path: {tmp_path / 'chat.jsonl'}, format: chat, "
                   f"eval_fraction: 0.1}}\nseq_len: 128\nmicro_batch_size: 4\ngrad_accum: 2\nsteps: 6\n"
                   f"eval_every: 3\noptimizer: {{lr: 3.0e-3}}\noutput_dir: {tmp_path / 'run'}\n")
    assert main(["data", str(cfg), "-n", "1"]) == 0
    shown = capsys.readouterr().out
    assert "plus" in shown
    assert len(reads) == 1  # the summary and the examples shown come from one read of the file
    assert main(["finetune", str(cfg), "--no-progress"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_loss" in r] == [3, 6]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "export")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "run" / "export")
    assert tok.chat_template and model.config.model_type == "qwen3"
    assert main(["export", str(tmp_path / "run"), "--step", "6", "--out", str(tmp_path / "again")]) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert a.equal(b), name


@pytest.mark.parametrize("n", ["0", "-1", "two"])
def test_data_refuses_a_count_below_one(n, capsys):
    """`slide-train data -n` counts examples to print: a count below one (which had printed all but the last
    example, or none) is refused by the argument parser, before any data is read."""
    with pytest.raises(SystemExit) as exit_info:
        main(["data", "-n", n])
    assert exit_info.value.code == 2
    assert f"expected a whole number of at least 1, got '{n}'" in capsys.readouterr().err


def test_step_time_and_throughput_count_the_whole_step(tmp_path, monkeypatch):
    """metrics' step_s, tokens_per_s and tflops count the trainer's whole step, the data it prepares included,
    not only the engine's step: a data loader that takes 50 ms per micro-batch shows in them (and in
    outside_engine_s), and the engine's own time is reported apart."""
    trainer = Trainer(load_config(None, ["--seq_len=32", "--micro_batch_size=2", "--grad_accum=2", "--export=false",
                                         f"--output_dir={tmp_path / 'run'}", "--steps=3"]), progress=False)
    loader = trainer.data.train
    next_micro_batch = loader.next_micro_batch

    def slow():
        time.sleep(0.05)
        return next_micro_batch()

    monkeypatch.setattr(loader, "next_micro_batch", slow)
    for _ in range(2):
        start = time.perf_counter()
        record = trainer.step()
        wall = time.perf_counter() - start
    trainer.close()
    assert record["engine_step_s"] + 0.1 <= record["step_s"] <= wall
    assert record["outside_engine_s"] == pytest.approx(record["step_s"] - record["engine_step_s"])
    assert record["tokens_per_s"] == pytest.approx(record["tokens"] / record["step_s"])
    assert record["tflops"] == pytest.approx(6 * trainer.num_params * record["tokens"] / record["step_s"] / 1e12)
