"""The built-in tokenizer and corpus (no download needed), and `slide-train data`'s rendering."""

import json

from transformers import AutoTokenizer

from slide_train.data import DataConfig, builtin_corpus_path, builtin_tokenizer, render_examples
from slide_train.data.corpus import generate_corpus


def test_builtin_tokenizer_is_bytes_plus_three_specials():
    tok = builtin_tokenizer()
    assert len(tok) == 259
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = bytes(range(256)).decode("latin-1") + " ü€ 😀 \n\t end"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == [3 + b for b in text.encode("utf-8")]
    assert tok.decode(ids) == text
    assert tok("<bos>x<eos>", add_special_tokens=False)["input_ids"] == [1, 3 + ord("x"), 2]
    assert tok("x")["input_ids"] == [3 + ord("x")]  # adds no special tokens by itself


def test_builtin_tokenizer_saves_and_loads(tmp_path):
    tok = builtin_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "Pim has 3 apples.\n"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    messages = [{"role": "user", "content": "hi"}]
    rendered = loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<bos><|user|>\nhi<eos>\n<|assistant|>\n"


def test_shipped_corpus_is_the_generators_output():
    """corpus.txt must be regenerated (python -m slide_train.data.corpus) whenever the generator changes."""
    assert builtin_corpus_path().read_text(encoding="utf-8") == generate_corpus()


def test_corpus_size_and_layout():
    text = builtin_corpus_path().read_text(encoding="utf-8")
    assert 100_000 <= len(text.encode()) <= 300_000
    docs = text.strip().split("\n\n")
    assert len(docs) == 2400 and all(d.strip() and "\n" not in d for d in docs)
    assert text.isascii()


def test_render_marks_no_loss_spans(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"instruction": "Add 2 and 3.", "output": "5"}) + "\n")
    out = render_examples(DataConfig(path=str(path), format="alpaca"), builtin_tokenizer(), 64)
    lines = out.splitlines()
    assert lines[0].endswith(
        "1 example from 1 record; 0 truncated to seq_len=64, 0 dropped (no loss token)"
    )
    assert lines[3] == f"--- {path}:1: 48 tokens, 2 with loss"
    assert "\n".join(lines[4:]) == "⟦<bos>### Instruction:\nAdd 2 and 3.\n\n### Response:\n⟧5<eos>"


def test_render_shows_n_examples_of_the_corpus():
    out = render_examples(DataConfig(), builtin_tokenizer(), 32, n=2)
    docs = builtin_corpus_path().read_text(encoding="utf-8").split("\n\n")
    headers = [line for line in out.splitlines() if line.startswith("--- ")]
    starts = [1, 3]  # the corpus's first two documents start on lines 1 and 3
    assert headers == [
        f"--- {builtin_corpus_path()}:{line}: 32 tokens, 31 with loss, "
        f"{len(doc) + 2 - 32} more continue in the next row"
        for line, doc in zip(starts, docs)
    ]
    assert f"⟦<bos>⟧{docs[0][:31]}\n" in out
