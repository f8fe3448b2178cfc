"""The training stream: deterministic by seed, reshuffled per epoch, exactly resumable; the eval split."""

import json

import pytest
import torch

from slide_train.data import DataConfig, DataError, build_data, builtin_corpus_path, builtin_tokenizer


def make_corpus(tmp_path, n=40):
    path = tmp_path / "c.txt"
    path.write_text("\n\n".join(f"document {i}: " + "x" * (i % 7) for i in range(n)) + "\n")
    return str(path)


def build(path, seed=0, seq_len=32, mbs=2, **kw):
    return build_data(DataConfig(path=path, **kw), builtin_tokenizer(), seq_len, mbs, seed)


def take(loader, n):
    return [loader.next_micro_batch() for _ in range(n)]


def same(a, b):
    return len(a) == len(b) and all(all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def test_same_seed_same_stream_other_seed_other_stream(tmp_path):
    path = make_corpus(tmp_path)
    n = 3 * build(path).train.rows_per_epoch // 2  # crosses at least one epoch boundary
    assert same(take(build(path).train, n), take(build(path).train, n))
    assert not same(take(build(path).train, n), take(build(path, seed=1).train, n))


def test_each_epoch_has_every_token_once_in_a_new_order(tmp_path):
    path = make_corpus(tmp_path)
    loader = build(path, mbs=1).train
    docs = {i: f"document {i}: " + "x" * (i % 7) for i in range(40)}
    tok = builtin_tokenizer()

    def epoch_text():
        rows = [loader.next_micro_batch() for _ in range(loader.rows_per_epoch)]
        return "".join(tok.decode(r["input_ids"][0][r["document_ids"][0] >= 0]) for r in rows)

    e0, e1 = epoch_text(), epoch_text()
    assert loader.epoch == 2
    for text in (e0, e1):
        assert text.count("<bos>") == text.count("<eos>") == 40
        assert sorted(text.replace("<bos>", "").split("<eos>")[:-1]) == sorted(docs.values())
    assert e0 != e1  # reshuffled


def test_no_shuffle_keeps_file_order(tmp_path):
    path = make_corpus(tmp_path, n=3)
    batch = build(path, seq_len=64, mbs=1, shuffle=False).train.next_micro_batch()
    text = builtin_tokenizer().decode(batch["input_ids"][0][batch["document_ids"][0] >= 0])
    assert text == "<bos>document 0: <eos><bos>document 1: x<eos><bos>document 2: xx<eos>"


@pytest.mark.parametrize("stop", [0, 1, 7, 8, 15, 16])
def test_resume_gives_the_same_micro_batches(tmp_path, stop):
    path = make_corpus(tmp_path)
    first = build(path, mbs=3).train
    # 23 rows an epoch, 3 a micro-batch: micro-batches 7 and 15 straddle the ends of epochs 0 and 1
    assert first.rows_per_epoch == 23
    take(first, stop)
    state = json.loads(json.dumps(first.state_dict()))  # it must survive a JSON file
    expected = take(first, 10)
    resumed = build(path, mbs=3).train
    resumed.load_state_dict(state)
    assert resumed.epoch == state["epoch"]
    assert same(take(resumed, 10), expected)


def test_resume_refuses_a_different_dataset_or_seed(tmp_path):
    path = make_corpus(tmp_path)
    state = build(path).train.state_dict()
    with pytest.raises(DataError, match="dataset, tokenizer, seq_len or seed differ"):
        build(path, seed=5).train.load_state_dict(state)
    with pytest.raises(DataError, match="dataset, tokenizer, seq_len or seed differ"):
        build(make_corpus(tmp_path, n=41)).train.load_state_dict(state)


@pytest.mark.parametrize(("key", "value"), [("seq_len", 16), ("pack", False), ("shuffle", False)])
def test_resume_refuses_another_row_layout(tmp_path, key, value):
    """A text dataset's tokens do not depend on seq_len, packing or shuffling, but its rows do: the saved row
    index would point into other rows (it resumed silently before)."""
    path = make_corpus(tmp_path)
    state = build(path).train.state_dict()
    other = build(path, **{key: value}).train
    with pytest.raises(DataError, match=rf"had {key}=.* \(now {value}\).*same values"):
        other.load_state_dict(state)
    legacy = {k: v for k, v in state.items() if k not in ("seq_len", "pack", "shuffle")}
    build(path).train.load_state_dict(legacy)  # a checkpoint from before these were saved still resumes


def test_eval_split_is_held_out_and_fixed(tmp_path):
    path = make_corpus(tmp_path)
    data = build(path, eval_fraction=0.25, eval_batches=2, seq_len=16, mbs=2)
    assert data.stats["eval_examples"] == 10 and data.stats["train_examples"] == 30
    assert len(data.eval) == 2 and all(b["input_ids"].shape == (2, 16) for b in data.eval)
    tok = builtin_tokenizer()
    # no held-out document appears in a training epoch
    train_text = "".join(
        tok.decode(b["input_ids"][r]) for b in take(data.train, data.train.rows_per_epoch) for r in range(2)
    )
    eval_docs = {
        doc for b in data.eval for r in range(2) for doc in tok.decode(b["input_ids"][r]).split("<bos>")[1:]
    }
    eval_docs = {d.split("<eos>")[0] for d in eval_docs if "<eos>" in d}
    assert eval_docs and not any(f"<bos>{d}<eos>" in train_text for d in eval_docs)
    again = build(path, eval_fraction=0.25, eval_batches=2, seq_len=16, mbs=2)
    assert same(data.eval, again.eval)


def test_eval_batches_padded_to_full_shape(tmp_path):
    path = make_corpus(tmp_path, n=10)
    data = build(path, eval_fraction=0.1, seq_len=64, mbs=4)  # one held-out document: one row of four
    [batch] = data.eval
    assert batch["input_ids"].shape == (4, 64)
    assert (batch["document_ids"][1:] == -1).all() and (batch["labels"][1:] == -100).all()


def test_builtin_corpus_default(tmp_path):
    data = build_data(DataConfig(), builtin_tokenizer(), 128, 4, 0)
    assert data.stats["source"] == str(builtin_corpus_path())
    assert data.train.rows_per_epoch > 1000
    assert data.eval is None
    batch = data.train.next_micro_batch()
    assert (batch["document_ids"] >= 0).all()  # text fills every row: no padding
    assert "train examples" in data.summary()


def test_epochs_count_each_epochs_own_rows():
    """Packing whole (unsplittable) examples in a new order each epoch gives each epoch its own row count; the
    rows of N epochs are what the stream really yields before its epoch counter reaches N."""
    from slide_train.data.formats import Example
    from slide_train.data.loader import Loader

    lengths = [6, 5, 4, 3, 7, 2, 6, 5, 3, 4, 8, 2, 5, 6, 3]
    examples = [Example(torch.arange(n), torch.arange(n), f"row {i}", splittable=False)
                for i, n in enumerate(lengths)]
    loader = Loader(examples, seq_len=10, micro_batch_size=1, seed=0, shuffle=True, pack=True, pad=0)
    counts = [len(loader.rows(epoch)) for epoch in range(3)]
    assert len(set(counts)) > 1  # the case this is about

    def yielded(epochs: int) -> int:
        stream, rows = Loader(examples, 10, 1, 0, True, True, 0), 0
        while stream.epoch < epochs:
            stream.next_micro_batch()
            rows += 1
        return rows

    assert [loader.rows_in(n) for n in (1, 2, 3)] == [yielded(1), yielded(2), yielded(3)]
    assert yielded(2) != 2 * counts[0]  # what counting epoch 0's rows twice gave (the old total_steps)
    assert loader.rows_in(1.6) == 10 + 6 and loader.rows_in(2.5) == 10 + 9 + 6  # 5.4 and 5.5 rows: rounded up
    same_every_epoch = Loader(examples, 10, 1, 0, False, False, 0)  # neither shuffled nor packed: a row each
    assert [len(same_every_epoch.rows(e)) for e in range(3)] == [15, 15, 15]
    # (1.6 - 1) * 15 is 9.000000000000002 in floats: still 9 rows
    assert same_every_epoch.rows_in(1.6) == 24 and same_every_epoch.rows_in(0.25) == 4
