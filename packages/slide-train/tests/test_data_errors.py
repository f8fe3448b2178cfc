"""Every way a dataset or data setting can be wrong gives a DataError that names the file, line or key."""

import json

import pytest

from slide_train.data import DataConfig, DataError, build_data, builtin_tokenizer, render_examples


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def jsonl(path, rows):
    return write(path, "".join(json.dumps(r) + "\n" for r in rows))


def build(path, fmt="text", tokenizer=None, seq_len=64, **kw):
    """tokenizer None: the built-in one; False: no tokenizer at all."""
    tokenizer = builtin_tokenizer() if tokenizer is None else tokenizer or None
    return build_data(DataConfig(path=path, format=fmt, **kw), tokenizer, seq_len, 2, 0)


def test_missing_file(tmp_path, monkeypatch):
    with pytest.raises(DataError, match=r"data\.path: file not found: .*nope\.txt"):
        build(str(tmp_path / "nope.txt"))
    monkeypatch.chdir(tmp_path)  # a relative path: the message says where it was looked for
    with pytest.raises(DataError, match=rf"file not found: nope\.txt \(looked for {tmp_path}/nope\.txt\)"):
        build("nope.txt")


def test_unknown_format_lists_the_valid_ones(tmp_path):
    with pytest.raises(
        DataError, match=r"unknown format 'csv'; valid formats: text, jsonl, alpaca, chat, sharegpt, tokens"
    ):
        build(write(tmp_path / "a.txt", "x"), fmt="csv")


def test_format_other_than_text_needs_a_path():
    with pytest.raises(DataError, match=r"data\.path: format 'chat' needs a file"):
        build(None, fmt="chat")


def test_empty_text_file_yields_no_tokens(tmp_path):
    with pytest.raises(
        DataError, match=r"empty\.txt: the dataset yields no tokens: the file has no documents"
    ):
        build(write(tmp_path / "empty.txt", "\n  \n\n"))


def test_no_label_tokens_after_truncation(tmp_path):
    path = jsonl(tmp_path / "a.jsonl", [{"instruction": "a long instruction " * 5, "output": "y"}])
    with pytest.raises(
        DataError, match=r"a\.jsonl: .*none has a label token; 1 was truncated to seq_len=64"
    ):
        build(path, fmt="alpaca")


def test_chat_without_assistant_turns_has_no_labels(tmp_path):
    path = jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(
        DataError, match=r"c\.jsonl: .*none has a label token; only assistant turns carry a loss"
    ):
        build(path, fmt="chat")


def test_tokens_with_all_labels_masked(tmp_path):
    path = jsonl(tmp_path / "t.jsonl", [{"input_ids": [5, 6], "labels": [-100, -100]}])
    with pytest.raises(DataError, match=r"t\.jsonl: the dataset yields no tokens to train on \(1 row read"):
        build(path, fmt="tokens")


def test_malformed_json_line(tmp_path):
    path = write(tmp_path / "t.jsonl", '{"text": "ok"}\n\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"t\.jsonl:3: not valid JSON"):
        build(path)


def test_row_not_an_object(tmp_path):
    with pytest.raises(DataError, match=r"t\.jsonl:1: expected a JSON object, got list"):
        build(write(tmp_path / "t.jsonl", "[1, 2]\n"), fmt="tokens")


def test_json_file_not_a_list(tmp_path):
    with pytest.raises(DataError, match=r"a\.json: a \.json dataset must be a list of objects"):
        build(write(tmp_path / "a.json", '{"instruction": "x"}'), fmt="alpaca")


@pytest.mark.parametrize(
    "fmt, rows, where, message",
    [
        ("text", [{"text": "a"}, {"body": "b"}], ":2", "missing key 'text' (row has keys: 'body')"),
        ("alpaca", [{"instruction": "a", "input": "b"}], ":1", "missing key 'output'"),
        ("alpaca", [{"instruction": 3, "output": "b"}], ":1", "key 'instruction' must be str, got int"),
        ("chat", [{"conversation": []}], ":1", "missing key 'messages'"),
        ("chat", [{"messages": [{"role": "user"}]}], ":1 messages[0]", "missing key 'content'"),
        ("chat", [{"messages": ["hi"]}], ":1", "messages[0] must be an object"),
        ("tokens", [{"input_ids": [1]}, {"ids": [1]}], ":2", "missing key 'input_ids'"),
        ("tokens", [{"input_ids": [1, 999]}], ":1", "'input_ids' must be integers in [0, 259)"),
        ("tokens", [{"input_ids": [1, True]}], ":1", "'input_ids' must be integers in [0, 259)"),
        (
            "tokens",
            [{"input_ids": [1, 2], "labels": [1]}],
            ":1",
            "'labels' has 1 entry but 'input_ids' has 2",
        ),
        (
            "tokens",
            [{"input_ids": [1, 2], "labels": [1, -5]}],
            ":1",
            "'labels' must be integers in [0, 259) or -100",
        ),
    ],
)
def test_malformed_rows_name_the_line_and_key(tmp_path, fmt, rows, where, message):
    path = jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(DataError) as err:
        build(path, fmt=fmt)
    assert str(err.value).startswith(f"{path}{where}: {message}")


def test_chat_needs_a_chat_template(tmp_path):
    tok = builtin_tokenizer()
    tok.chat_template = None
    path = jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(DataError, match=r"format 'chat' needs a tokenizer with a chat template"):
        build(path, fmt="chat", tokenizer=tok)


def test_chat_template_that_is_not_turn_by_turn(tmp_path):
    tok = builtin_tokenizer()
    # renders the last message differently from the others, so prefixes are not prefixes of the whole
    tok.chat_template = (
        "{% for m in messages %}{% if loop.last %}END {% endif %}{{ m['content'] }}\n{% endfor %}"
    )
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    path = jsonl(tmp_path / "c.jsonl", rows)
    with pytest.raises(
        DataError, match=r"c\.jsonl:1: cannot find assistant turn 1 in the chat template's output"
    ):
        build(path, fmt="chat", tokenizer=tok)


def test_chat_template_that_raises(tmp_path):
    tok = builtin_tokenizer()
    tok.chat_template = "{{ raise_exception('only user turns please') }}"
    path = jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "q"}]}])
    with pytest.raises(
        DataError, match=r"c\.jsonl:1: the tokenizer's chat template failed .*only user turns"
    ):
        build(path, fmt="chat", tokenizer=tok)


def test_non_json_extension_for_row_formats(tmp_path):
    with pytest.raises(DataError, match=r"a\.txt: format 'alpaca' reads \.jsonl, \.json, \.parquet, \.arrow files "
                                        r"or a folder written by datasets' save_to_disk"):
        build(write(tmp_path / "a.txt", "x"), fmt="alpaca")


def test_not_utf8(tmp_path):
    path = tmp_path / "b.txt"
    path.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(DataError, match=r"b\.txt: not UTF-8 text"):
        build(str(path))


@pytest.mark.parametrize(
    "kw, seq_len, message",
    [
        ({"eval_fraction": 1.0}, 64, r"data\.eval_fraction: must be in \[0, 1\), got 1\.0"),
        ({"eval_batches": 0}, 64, r"data\.eval_batches: must be at least 1"),
        ({}, 1, r"seq_len: must be at least 2"),
    ],
)
def test_impossible_settings(tmp_path, kw, seq_len, message):
    with pytest.raises(DataError, match=message):
        build(write(tmp_path / "a.txt", "x"), seq_len=seq_len, **kw)


def test_eval_split_too_small(tmp_path):
    with pytest.raises(DataError, match=r"data\.eval_fraction=0\.5: .*a\.txt has only 1 example,"):
        build(write(tmp_path / "a.txt", "x"), eval_fraction=0.5)


def test_render_examples_reports_errors_too(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        render_examples(DataConfig(path=str(tmp_path / "x.txt")), builtin_tokenizer(), 64)


def test_text_needs_a_tokenizer(tmp_path):
    with pytest.raises(DataError, match=r"data\.format 'text' needs a tokenizer; only format 'tokens'"):
        build(write(tmp_path / "a.txt", "x"), tokenizer=False)


def test_token_ids_are_checked_against_the_models_vocabulary_without_a_tokenizer(tmp_path):
    """Pre-tokenized rows need no tokenizer; the model's vocabulary still bounds the ids (an id past it would
    fail deep inside the embedding)."""
    path = jsonl(tmp_path / "t.jsonl", [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 300]}])
    cfg = DataConfig(path=str(path), format="tokens")
    with pytest.raises(DataError, match=r":2: 'input_ids' must be integers in \[0, 256\) \(the vocabulary"):
        build_data(cfg, None, 8, 1, seed=0, vocab_size=256)
    assert build_data(cfg, None, 8, 1, seed=0, vocab_size=512).train is not None
