"""Datasets as they come: parquet, arrow and save_to_disk folders read through HF datasets, ShareGPT rows, role
names mapped by data.roles, unknown roles refused with their row, and dropped rows named.

The same conversations written as each file type and layout must give exactly the examples of a chat .jsonl,
whose ids and label masks are computed here independently: the built-in tokenizer maps byte b to id 3 + b and
<pad>, <bos>, <eos> to 0, 1, 2.
"""

from __future__ import annotations

import json
import re
import socket

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from slide_train.config import load_config
from slide_train.data import DataConfig, DataError, build_data, builtin_tokenizer, render_examples
from slide_train.data.formats import load_examples
from slide_train.data.sources import read_rows

X = -100
SPECIAL = {"<pad>": 0, "<bos>": 1, "<eos>": 2}

# The built-in template, with a message's `name` when it has one: arrow gives every message of a column a
# `name`, null where none was written, and no null may reach the template as a name.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' }}"
    "{% if m.name is defined %}{{ '(' + m.name + ')' }}{% endif %}"
    "{{ '\n' + m['content'] + eos_token + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}],
    [{"role": "user", "content": "Hi, I am Ann.", "name": "ann"}, {"role": "assistant", "content": "Hello Ann."},
     {"role": "user", "content": "And 3+3?", "name": "ann"}, {"role": "assistant", "content": "6, é ü"}],
    [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": '{"city": "Oslo"}'},
     {"role": "tool", "content": "-3 C, snow"}, {"role": "assistant", "content": "Cold: -3 C and snowing."}],
    [{"role": "system", "content": "Answer in Japanese."}, {"role": "user", "content": "cat?"},
     {"role": "assistant", "content": "猫"}],
]
SHAREGPT_NAMES = {"system": "system", "user": "human", "tool": "observation"}


def tokenizer():
    tok = builtin_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def byte_ids(text: str) -> list[int]:
    ids = []
    for part in re.split(r"(<pad>|<bos>|<eos>)", text):
        ids += [SPECIAL[part]] if part in SPECIAL else [3 + b for b in part.encode("utf-8")]
    return ids


def reference(messages: list[dict]) -> tuple[list[int], list[int]]:
    """The template's text piece by piece, with a loss on each answer (an assistant turn after the first)."""
    ids, labels = byte_ids("<bos>"), [X]
    for i, m in enumerate(messages):
        name = f"({m['name']})" if "name" in m else ""
        head, body = byte_ids(f"<|{m['role']}|>{name}\n"), byte_ids(m["content"] + "<eos>\n")
        ids += head + body
        labels += [X] * len(head) + (body if m["role"] == "assistant" and i > 0 else [X] * len(body))
    return ids, labels


def sharegpt_row(messages: list[dict], i: int) -> dict:
    """The conversation in ShareGPT's layout; the first one's system prompt in the row's `system` key."""
    turns = [{**{k: v for k, v in m.items() if k not in ("role", "content")},
              "from": SHAREGPT_NAMES.get(m["role"], "gpt"), "value": m["content"]} for m in messages]
    if i == 0:
        return {"system": turns[0]["value"], "conversations": turns[1:]}
    # the third conversation's first answer is a tool call the model learns to make (`function_call`)
    return {"conversations": [{**t, "from": "function_call"} if (i, j) == (2, 1) else t
                              for j, t in enumerate(turns)]}


def rows(layout: str, conversations=CONVERSATIONS) -> list[dict]:
    if layout == "chat":
        return [{"messages": m} for m in conversations]
    return [sharegpt_row(m, i) for i, m in enumerate(conversations)]


def write_jsonl(path, items):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in items), encoding="utf-8")
    return path


def write_arrow(path, items, ipc_file: bool):
    """An .arrow file in the IPC stream format (as HF datasets writes it) or the IPC file format (Feather v2)."""
    table = pa.Table.from_pylist(items)
    with pa.OSFile(str(path), "wb") as f, (pa.ipc.new_file if ipc_file else pa.ipc.new_stream)(f, table.schema) as w:
        w.write_table(table)
    return path


KINDS = ["sharegpt.jsonl", "chat.json", "chat.parquet", "sharegpt.parquet", "chat.arrow (stream)",
         "chat.arrow (file)", "chat save_to_disk", "sharegpt save_to_disk (DatasetDict)"]


def write(kind: str, directory):
    """CONVERSATIONS as a file (or folder) of the given kind, made with the library its users would use."""
    layout = kind.split(".")[0].split(" ")[0]
    items = rows(layout)
    if kind.endswith(".jsonl"):
        return write_jsonl(directory / "d.jsonl", items)
    if kind.endswith(".json"):
        (directory / "d.json").write_text(json.dumps(items))
        return directory / "d.json"
    if kind == "chat.parquet":
        pq.write_table(pa.Table.from_pylist(items), directory / "d.parquet")
        return directory / "d.parquet"
    if kind.endswith(".parquet"):
        datasets.Dataset.from_list(items).to_parquet(directory / "d.parquet")
        return directory / "d.parquet"
    if "arrow" in kind:
        return write_arrow(directory / "d.arrow", items, ipc_file="file" in kind)
    if "DatasetDict" in kind:
        datasets.DatasetDict({"train": datasets.Dataset.from_list(items),
                              "test": datasets.Dataset.from_list(items[:1])}).save_to_disk(directory / "d")
    else:
        datasets.Dataset.from_list(items).save_to_disk(directory / "d")
    return directory / "d"


def examples(cfg: DataConfig, seq_len: int = 256):
    loaded = load_examples(cfg, tokenizer(), seq_len)
    return [(ex.input_ids.tolist(), ex.labels.tolist(), ex.row) for ex in loaded.examples]


def batches(cfg: DataConfig, n: int = 4) -> list[dict]:
    data = build_data(cfg, tokenizer(), 192, 2, seed=3)
    return [data.train.next_micro_batch() for _ in range(n)]


def test_the_chat_jsonl_reference_is_the_template_text_with_loss_on_answers(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", rows("chat"))
    got = examples(DataConfig(path=str(path), format="chat"))
    assert got == [(*reference(m), i) for i, m in enumerate(CONVERSATIONS, start=1)]


@pytest.mark.parametrize("kind", KINDS)
def test_every_file_type_and_layout_gives_the_examples_of_the_chat_jsonl(tmp_path, kind):
    want_path = write_jsonl(tmp_path / "c.jsonl", rows("chat"))
    want = DataConfig(path=str(want_path), format="chat")
    (tmp_path / "other").mkdir()
    cfg = DataConfig(path=str(write(kind, tmp_path / "other")), format=kind.split(".")[0].split(" ")[0])
    assert examples(cfg) == examples(want) == [(*reference(m), i) for i, m in enumerate(CONVERSATIONS, start=1)]
    for a, b in zip(batches(cfg), batches(want), strict=True):  # packed, shuffled and padded alike
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_text_and_tokens_from_parquet_equal_their_jsonl(tmp_path):
    docs = [{"text": "first document", "id": 1}, {"text": "zweite Über", "id": 2}, {"text": "third", "id": 3}]
    pq.write_table(pa.Table.from_pylist(docs), tmp_path / "t.parquet")
    got = examples(DataConfig(path=str(tmp_path / "t.parquet"), format="text"))
    assert got == [(byte_ids(f"<bos>{d['text']}<eos>"), [X, *byte_ids(f"{d['text']}<eos>")], i)
                   for i, d in enumerate(docs, start=1)]
    assert got == examples(DataConfig(path=str(write_jsonl(tmp_path / "t.jsonl", docs)), format="jsonl"))

    # labels only on some rows: arrow gives the others a null, which reads as no labels (train on every token)
    toks = [{"input_ids": [9, 10, 11], "labels": [X, 10, X]}, {"input_ids": [5, 6, 7, 8]}]
    pq.write_table(pa.Table.from_pylist(toks), tmp_path / "k.parquet")  # (columns: the first row's keys)
    got = examples(DataConfig(path=str(tmp_path / "k.parquet"), format="tokens"))
    assert got == [([9, 10, 11], [X, 10, X], 1), ([5, 6, 7, 8], [X, 6, 7, 8], 2)]
    assert got == examples(DataConfig(path=str(write_jsonl(tmp_path / "k.jsonl", toks)), format="tokens"))


def test_rows_stream_and_nothing_is_downloaded_or_cached(tmp_path, monkeypatch):
    """Parquet streams (its row count from the footer), arrow and save_to_disk are memory-mapped in place: the
    datasets cache gets no copy of the data (lock files only) and no connection is opened."""
    cache = tmp_path / "cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)

    def refuse(*args, **kwargs):
        raise AssertionError(f"a connection was opened: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    n = len(CONVERSATIONS)
    # (the IPC file format streams through datasets' arrow reader, which does not count rows up front)
    totals = {"chat.parquet": n, "chat.arrow (stream)": n, "chat.arrow (file)": None, "chat save_to_disk": n}
    for kind, total in totals.items():
        (tmp_path / kind).mkdir()
        records = read_rows(write(kind, tmp_path / kind))
        assert not isinstance(records.items, list), kind  # read as iterated, not loaded whole
        assert records.total == total, kind
        assert [r.value for r in records] == rows("chat"), kind  # nulls of absent `name`s dropped
    assert [p for p in cache.rglob("*") if p.is_file() and not p.name.endswith(".lock")] == []


@pytest.mark.parametrize("kind, where", [("jsonl", ":3"), ("json", " row 3"), ("parquet", " row 3")])
def test_an_unknown_role_is_refused_with_its_row_and_file_until_data_roles_maps_it(tmp_path, kind, where):
    convs = [*CONVERSATIONS[:2], [{"role": "usr", "content": "2+2?"}, {"role": "assistant", "content": "4"}]]
    items = rows("chat", convs)
    path = tmp_path / f"c.{kind}"
    if kind == "jsonl":
        write_jsonl(path, items)
    elif kind == "json":
        path.write_text(json.dumps(items))
    else:
        pq.write_table(pa.Table.from_pylist(items), path)
    with pytest.raises(DataError) as err:
        examples(DataConfig(path=str(path), format="chat"))
    assert str(err.value) == (f"{path}{where} messages[0]: unknown role 'usr'; known roles: system, user, assistant, "
                              "tool; map other names onto them with data.roles (e.g. --data.roles.usr=user)")
    mapped = examples(DataConfig(path=str(path), format="chat", roles={"usr": "user"}))
    assert mapped == examples(DataConfig(path=str(write_jsonl(tmp_path / "ref.jsonl", rows("chat", [
        *convs[:2], [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]]))), format="chat"))


def test_sharegpt_names_and_data_roles(tmp_path):
    items = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "yo"}]}]
    path = write_jsonl(tmp_path / "s.jsonl", items)
    with pytest.raises(DataError, match=re.escape(
            f"{path}:1 conversations[1]: unknown role 'bot'; known roles: system, user, assistant, tool (and the "
            "names function_call, gpt, human, observation for them); map other names onto them with data.roles")):
        examples(DataConfig(path=str(path), format="sharegpt"))
    got = examples(DataConfig(path=str(path), format="sharegpt", roles={"bot": "assistant"}))
    assert got == [(*reference([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]), 1)]
    # a role of the template's own passes when mapped to itself; data.roles wins over ShareGPT's own names
    items = [{"conversations": [{"from": "developer", "value": "be kind"}, {"from": "human", "value": "hi"},
                                {"from": "gpt", "value": "yo"}]}]
    path = write_jsonl(tmp_path / "d.jsonl", items)
    got = examples(DataConfig(path=str(path), format="sharegpt", roles={"developer": "developer"}))
    assert got == [(*reference([{"role": "developer", "content": "be kind"}, {"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "yo"}]), 1)]
    with pytest.raises(DataError, match=r"none has a label token; only assistant turns carry a loss"):
        examples(DataConfig(path=str(path), format="sharegpt", roles={"developer": "developer", "gpt": "user"}))


def test_data_roles_from_the_config(tmp_path):
    base = [f"--data.path={tmp_path / 'c.jsonl'}", "--data.format=chat"]
    assert load_config(None, [*base, "--data.roles.usr=user", "--data.roles.bot=assistant"]).data.roles == {
        "usr": "user", "bot": "assistant"}
    assert load_config(None, [*base, "--data.roles={usr: user}"]).data.roles == {"usr": "user"}
    assert load_config(None, base).data.roles == {}
    with pytest.raises(DataError, match=r"data\.roles: 'usr' maps to 'usre', which is not one of the roles system, "
                                        r"user, assistant, tool; .* mapped to itself \(e\.g\. \{usre: usre\}\)"):
        load_config(None, [*base, "--data.roles.usr=usre"])
    config = tmp_path / "run.yaml"
    config.write_text("data: {path: c.jsonl, format: chat, roles: {yes: user}}\n")
    with pytest.raises(DataError, match=r"data\.roles: True: 'user' is not one role name mapped to another; quote"):
        load_config(config)


def test_dropped_rows_are_counted_and_named(tmp_path):
    answered = rows("chat")[0]
    unanswered = {"messages": [{"role": "user", "content": "hello?"}]}
    items = [answered, unanswered, answered, unanswered, {"messages": [{"role": "system", "content": "s"}]}]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in items[:3]) + "\n\n" + "\n".join(json.dumps(r) for r in items[3:]))
    cfg = DataConfig(path=str(path), format="chat")
    with pytest.warns(UserWarning, match=re.escape(
            f"{path}: 3 examples have no token with a loss and were dropped (lines 2, 5, 6); only assistant turns "
            "carry a loss")):
        data = build_data(cfg, tokenizer(), 96, 2, 0)
    assert (data.stats["records"], data.stats["train_examples"], data.stats["dropped"]) == (5, 2, 3)
    assert data.summary().endswith("; 0 truncated, 3 dropped (no loss token: lines 2, 5, 6)")
    assert render_examples(cfg, tokenizer(), 96, loaded=data.loaded).splitlines()[0].endswith(
        "2 examples from 5 records; 0 truncated to seq_len=96, 3 dropped (no loss token: lines 2, 5, 6)")

    # from parquet, by row; past the first five, the count and "..."
    items = [unanswered] * 3 + [answered] + [unanswered] * 4
    pq.write_table(pa.Table.from_pylist(items), tmp_path / "c.parquet")
    with pytest.warns(UserWarning, match=re.escape("7 examples have no token with a loss and were dropped "
                                                   "(rows 1, 2, 3, 5, 6, ...)")):
        data = build_data(DataConfig(path=str(tmp_path / "c.parquet"), format="chat"), tokenizer(), 96, 2, 0)
    assert (data.stats["records"], data.stats["train_examples"], data.stats["dropped"]) == (8, 1, 7)


def test_files_that_cannot_be_read(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not a parquet file at all")
    with pytest.raises(DataError, match=r"bad\.parquet: cannot read it as a \.parquet file"):
        build_data(DataConfig(path=str(tmp_path / "bad.parquet"), format="chat"), tokenizer(), 96, 2, 0)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.txt").write_text("hi")
    with pytest.raises(DataError, match=r"folder: cannot read it as a folder written by datasets' save_to_disk"):
        build_data(DataConfig(path=str(tmp_path / "folder"), format="chat"), tokenizer(), 96, 2, 0)
    splits = datasets.DatasetDict({"a": datasets.Dataset.from_list(rows("chat")),
                                   "b": datasets.Dataset.from_list(rows("chat"))})
    splits.save_to_disk(tmp_path / "splits")
    with pytest.raises(DataError, match=r"splits: a DatasetDict with splits a, b and none named 'train': set "
                                        r"data\.path to the folder of the split to train on \(e\.g\. .*splits/a\)"):
        build_data(DataConfig(path=str(tmp_path / "splits"), format="chat"), tokenizer(), 96, 2, 0)
    assert examples(DataConfig(path=str(tmp_path / "splits" / "a"), format="chat"))[0] == (*reference(
        CONVERSATIONS[0]), 1)
    pq.write_table(pa.Table.from_pylist([{"messages": [{"role": "user", "content": "hi"}], "other": 0}, {"other": 1}]),
                   tmp_path / "keys.parquet")
    with pytest.raises(DataError, match=r"keys\.parquet row 2: missing key 'messages' \(row has keys: 'other'\)"):
        examples(DataConfig(path=str(tmp_path / "keys.parquet"), format="chat"))


def test_finetune_on_a_parquet_chat_file(tmp_path, monkeypatch):
    from slide_train import progress
    from slide_train.cli import main
    from slide_train.metrics import read_metrics

    monkeypatch.setattr(progress, "_hidden", False)  # --no-progress hides bars for the whole process: undone after

    conversations = [[{"role": "user", "content": f"What is {a} plus {b}?"},
                      {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]
                     for a in range(6) for b in range(4)]
    pq.write_table(pa.Table.from_pylist(rows("chat", conversations)), tmp_path / "chat.parquet")
    assert main(["finetune", f"--data.path={tmp_path / 'chat.parquet'}", "--data.format=chat", "--steps=2",
                 "--seq_len=64", "--micro_batch_size=2", "--grad_accum=1", f"--output_dir={tmp_path / 'run'}",
                 "--export=false", "--no-progress"]) == 0
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["loss"] > 0 for r in steps)
