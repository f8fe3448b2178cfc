"""Each data format on small files, label masks checked token by token against an independent computation.

The built-in tokenizer maps byte b to id 3 + b and <pad>, <bos>, <eos> to 0, 1, 2, so the expected ids and
labels are computed here straight from the text's UTF-8 bytes, without the pipeline's tokenization code.
"""

import json
import re

import pytest
from transformers import AutoTokenizer

from slide_train.data import DataConfig, build_data, builtin_tokenizer, render_examples
from slide_train.data.formats import load_examples

SPECIAL = {"<pad>": 0, "<bos>": 1, "<eos>": 2}
X = -100


def byte_ids(text: str) -> list[int]:
    """Ids of the built-in tokenizer, computed independently: special tokens by name, the rest by byte."""
    ids = []
    for part in re.split(r"(<pad>|<bos>|<eos>)", text):
        ids += [SPECIAL[part]] if part in SPECIAL else [3 + b for b in part.encode("utf-8")]
    return ids


def expected(segments: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """(ids, labels) from (text, trained) segments; the first label is always -100 (see formats.py)."""
    ids, labels = [], []
    for text, trained in segments:
        part = byte_ids(text)
        ids += part
        labels += part if trained else [X] * len(part)
    labels[0] = X
    return ids, labels


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def examples(cfg, tokenizer=None, seq_len=512):
    loaded = load_examples(cfg, tokenizer or builtin_tokenizer(), seq_len)
    return [(ex.input_ids.tolist(), ex.labels.tolist()) for ex in loaded.examples]


def test_text_file_documents_split_on_blank_lines(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("first doc\nsecond line\n\n\n  \nzweite Über\n\nthird\n", encoding="utf-8")
    got = examples(DataConfig(path=str(path), format="text"))
    docs = ["first doc\nsecond line", "zweite Über", "third"]
    assert got == [expected([("<bos>" + d + "<eos>", True)]) for d in docs]


def test_text_documents_tokenized_in_batches_keep_their_order(tmp_path, monkeypatch):
    from slide_train.data import formats
    monkeypatch.setattr(formats, "ENCODE_BATCH", 2)  # 5 documents: batches of 2, 2 and 1
    docs = ["one", "two two", "three", "four four four", "five"]
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    got = examples(DataConfig(path=str(path), format="text"))
    assert got == [expected([("<bos>" + d + "<eos>", True)]) for d in docs]


def test_text_jsonl_rows_with_text_key(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"body": "a b"}, {"body": "ccc", "other": 1}])
    got = examples(DataConfig(path=path, format="text", text_key="body"))
    assert got == [expected([("<bos>a b<eos>", True)]), expected([("<bos>ccc<eos>", True)])]
    # format `jsonl` reads rows whatever the extension
    other = tmp_path / "rows.data"
    other.write_text(json.dumps({"text": "xy"}) + "\n")
    assert examples(DataConfig(path=str(other), format="jsonl")) == [expected([("<bos>xy<eos>", True)])]


def test_text_without_bos_eos_tokenizer(tmp_path):
    """A tokenizer with no bos/eos (e.g. Qwen has no bos) gets none added."""
    tok = builtin_tokenizer()
    tok.bos_token = None
    path = tmp_path / "c.txt"
    path.write_text("hello\n")
    assert examples(DataConfig(path=str(path)), tok) == [expected([("hello<eos>", True)])]


def test_alpaca_loss_only_on_output(tmp_path):
    rows = [
        {"instruction": "Add.", "input": "2 and 3", "output": "5"},
        {"instruction": "Say hi.", "output": "hi there"},
        {"instruction": "Empty input.", "input": "", "output": "ok"},
    ]
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    got = examples(DataConfig(path=path, format="alpaca"))
    prompts = [
        "<bos>### Instruction:\nAdd.\n\n### Input:\n2 and 3\n\n### Response:\n",
        "<bos>### Instruction:\nSay hi.\n\n### Response:\n",
        "<bos>### Instruction:\nEmpty input.\n\n### Response:\n",
    ]
    outputs = ["5<eos>", "hi there<eos>", "ok<eos>"]
    assert got == [expected([(p, False), (o, True)]) for p, o in zip(prompts, outputs)]
    # the same rows from a .json list
    json_path = tmp_path / "a.json"
    json_path.write_text(json.dumps(rows))
    assert examples(DataConfig(path=str(json_path), format="alpaca")) == got


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "and 3+3?"},
    {"role": "assistant", "content": "6, é"},
]


def test_chat_builtin_template_saved_and_loaded(tmp_path):
    builtin_tokenizer().save_pretrained(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}])
    got = examples(DataConfig(path=path, format="chat"), tok)
    # The built-in template: <bos>, then "<|role|>\n" + content + "<eos>\n" per message.
    want = expected(
        [
            ("<bos><|system|>\nBe brief.<eos>\n<|user|>\n2+2?<eos>\n<|assistant|>\n", False),
            ("4<eos>\n", True),
            ("<|user|>\nand 3+3?<eos>\n<|assistant|>\n", False),
            ("6, é<eos>\n", True),
        ]
    )
    assert got == [want]


CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_chat_other_template_from_local_tokenizer(tmp_path):
    """A ChatML-style template with special tokens added to the vocabulary, saved and loaded from disk."""
    tok = builtin_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    tok.save_pretrained(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert (start, end) == (259, 260)
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION[1:3]}])
    [(ids, labels)] = examples(DataConfig(path=path, format="chat"), tok)

    def b(s):
        return [3 + c for c in s.encode()]

    want_ids = [start, *b("user\n2+2?"), end, *b("\n"), start, *b("assistant\n"), *b("4"), end, *b("\n")]
    n_prompt = len(want_ids) - 3  # "4", <|im_end|>, "\n" are the assistant's span
    assert ids == want_ids
    assert labels == [X] * n_prompt + want_ids[n_prompt:]


def test_chat_row_without_assistant_is_dropped(tmp_path):
    rows = [{"messages": CONVERSATION[:2]}, {"messages": CONVERSATION[:3]}]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    loaded = load_examples(DataConfig(path=path, format="chat"), builtin_tokenizer(), 512)
    assert (len(loaded.examples), loaded.dropped) == (1, 1)
    assert loaded.examples[0].where.endswith("c.jsonl:2")


def test_tokens_used_exactly_as_given(tmp_path):
    rows = [
        {"input_ids": [5, 6, 7, 8]},
        {"input_ids": [9, 10, 11], "labels": [X, 10, X]},
        {"input_ids": [3, 4, 5, 6, 7, 8, 9]},  # longer than seq_len=3: split into chunks
    ]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    loaded = load_examples(DataConfig(path=path, format="tokens"), builtin_tokenizer(), 3)
    got = [(ex.input_ids.tolist(), ex.labels.tolist()) for ex in loaded.examples]
    # one-token pieces ([8] and [9]) have no label once the first is masked: dropped, their rows kept
    assert got == [
        ([5, 6, 7], [X, 6, 7]),
        ([9, 10, 11], [X, 10, X]),
        ([3, 4, 5], [X, 4, 5]),
        ([6, 7, 8], [X, 7, 8]),
    ]
    assert (loaded.dropped, loaded.dropped_pieces, loaded.dropped_piece_tokens) == (0, 2, 2)
    assert loaded.dropped_where(pieces=True) == "lines 1, 3"


def test_rows_one_token_longer_than_seq_len_lose_only_that_token(tmp_path):
    """Rows of 65 tokens at seq_len=64: each trains its first 64, and the warning counts the 11 one-token pieces,
    not examples; a row whose labels are all -100 is still a dropped example."""
    rows = [{"input_ids": [3 + (7 * i + j) % 250 for j in range(65)]} for i in range(11)]
    rows.append({"input_ids": [5, 6, 7], "labels": [X, X, X]})
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.warns(UserWarning) as caught:
        data = build_data(DataConfig(path=path, format="tokens", pack=False), builtin_tokenizer(), 64, 1, 0)
    messages = [str(w.message) for w in caught]
    assert (f"{path}: rows longer than seq_len=64 are cut into pieces of 64 tokens, each piece's first token "
            "without a loss; 11 pieces (11 tokens in all) have no token with a loss left and were dropped (lines 1, "
            "2, 3, 4, 5, ...); the rest of their rows trains") in messages
    assert f"{path}: 1 example has no token with a loss and was dropped (line 12)" in messages
    assert [ex.input_ids.tolist() for ex in data.loaded.examples] == [r["input_ids"][:64] for r in rows[:11]]
    assert (data.stats["dropped"], data.stats["dropped_pieces"], data.stats["train_label_tokens"]) == (1, 11, 11 * 63)


def test_truncation_of_alpaca_warns_with_count(tmp_path):
    prompt = "<bos>### Instruction:\ni\n\n### Response:\n"
    rows = [{"instruction": "i", "output": "x" * 100}, {"instruction": "i", "output": "short"}]
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    cfg = DataConfig(path=path, format="alpaca", shuffle=False)
    with pytest.warns(UserWarning, match=r"1 of 2 examples is longer than seq_len=48"):
        data = build_data(cfg, builtin_tokenizer(), 48, 2, 0)
    assert data.stats["truncated"] == 1
    batch = data.train.next_micro_batch()
    want_ids, want_labels = expected([(prompt, False), ("x" * 100 + "<eos>", True)])
    assert batch["input_ids"][0].tolist() == want_ids[:48]
    assert batch["labels"][0].tolist() == want_labels[:48]
    want_ids, want_labels = expected([(prompt, False), ("short<eos>", True)])
    assert batch["input_ids"][1, : len(want_ids)].tolist() == want_ids
    assert batch["labels"][1].tolist() == want_labels + [X] * (48 - len(want_ids))


def test_tokens_without_a_tokenizer(tmp_path):
    """The trainer loads no tokenizer for pre-tokenized data: ids are then only checked to be >= 0."""
    path = write_jsonl(tmp_path / "t.jsonl", [{"input_ids": [7, 70000, 9]}])
    data = build_data(DataConfig(path=path, format="tokens"), None, 4, 1, 0)
    batch = data.train.next_micro_batch()
    assert batch["input_ids"].tolist() == [[7, 70000, 9, 0]]
    assert batch["labels"].tolist() == [[X, 70000, 9, X]]
    assert render_examples(DataConfig(path=path, format="tokens"), None, 4).endswith("⟦7 ⟧70000 9 ")


def test_alpaca_input_may_be_null(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "Hi.", "input": None, "output": "yo"}])
    got = examples(DataConfig(path=path, format="alpaca"))
    assert got == [expected([("<bos>### Instruction:\nHi.\n\n### Response:\n", False), ("yo<eos>", True)])]


def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Metaspace, prefix on the first word; characters as tokens), as Llama-2
    and Mistral's are: a piece tokenized on its own gets a '▁' the whole text does not have there."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set("abcdefghijklmnopqrstuvwxyz[]/#:.\n") | {"▁"})
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[inst] {{ m['content'] }}"
                          " [/inst]{% else %}{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}"
                          "{% endif %}{% endfor %}")
    return fast


def test_answers_of_a_metaspace_tokenizer_are_tokenized_as_in_the_whole_text(tmp_path):
    """Chat and alpaca answers get the tokens the whole text has: no extra '▁' at the answer's start (they did
    when each piece was tokenized on its own), and the chat mask is transformers' own assistant mask."""
    tok = metaspace_tokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "and"}, {"role": "assistant", "content": "ok then"}]
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    ((ids, labels),) = examples(DataConfig(path=str(tmp_path / "chat.jsonl"), format="chat"), tok)
    whole = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids == list(whole["input_ids"])
    assert labels == [t if m else -100 for t, m in zip(whole["input_ids"], whole["assistant_masks"])]
    assert tok.convert_ids_to_tokens([t for t in labels if t != -100]) == [
        "y", "o", "</s>", "o", "k", "▁", "t", "h", "e", "n", "</s>"]

    write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "say", "input": "", "output": "yo"}])
    ((ids, labels),) = examples(DataConfig(path=str(tmp_path / "alpaca.jsonl"), format="alpaca"), tok)
    from slide_train.data.formats import alpaca_prompt

    text = alpaca_prompt("say", "") + "yo"
    assert ids == [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert tok.convert_ids_to_tokens([t for t in labels if t != -100]) == ["y", "o", "</s>"]


def test_chat_opening_assistant_turn_is_context_not_an_error(tmp_path):
    """A conversation opening with an assistant turn stopped the whole dataset (its prompt, an empty
    conversation, cannot be rendered); it is context now, and later answers train. Found by a review."""
    tok = builtin_tokenizer()
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"}]}])
    got = examples(DataConfig(path=path, format="chat"), tok)
    want = expected([("<bos><|assistant|>\nHello!<eos>\n<|user|>\nhi<eos>\n<|assistant|>\n", False),
                     ("yo<eos>\n", True)])
    assert got == [want]
