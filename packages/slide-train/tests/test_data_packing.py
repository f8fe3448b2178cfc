"""Packing: rows, per-document position_ids and document_ids, padding, attention within documents only."""

import json

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from slide_train.data import DataConfig, build_data, builtin_tokenizer, document_attention_mask

X = -100


def tokens_file(tmp_path, rows, labels=False):
    """Rows of format `tokens`; with `labels` each row gives its labels (its ids), which keeps it whole."""
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"input_ids": r} | ({"labels": r} if labels else {})) + "\n" for r in rows))
    return str(path)


def batches(path, seq_len, mbs, n, fmt="tokens", pack=True):
    cfg = DataConfig(path=path, format=fmt, shuffle=False, pack=pack)
    loader = build_data(cfg, builtin_tokenizer(), seq_len, mbs, seed=0).train
    return [loader.next_micro_batch() for _ in range(n)]


def test_whole_examples_next_fit(tmp_path):
    a, b, c, d = [10, 11, 12, 13, 14], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36], [40, 41]
    path = tokens_file(tmp_path, [a, b, c, d], labels=True)
    [batch] = batches(path, 8, 3, 1)
    # row 0: a + b fill it; row 1: c, and d (2) does not fit in the 1 left: padding; row 2: d
    assert batch["input_ids"].tolist() == [a + b, c + [0], d + [0] * 6]
    assert batch["position_ids"].tolist() == [
        [0, 1, 2, 3, 4, 0, 1, 2],
        [0, 1, 2, 3, 4, 5, 6, 0],
        [0, 1, 0, 0, 0, 0, 0, 0],
    ]
    assert batch["document_ids"].tolist() == [
        [0, 0, 0, 0, 0, 1, 1, 1],
        [0, 0, 0, 0, 0, 0, 0, -1],
        [0, 0, -1, -1, -1, -1, -1, -1],
    ]
    assert batch["labels"].tolist() == [
        [X, 11, 12, 13, 14, X, 21, 22],
        [X, 31, 32, 33, 34, 35, 36, X],
        [X, 41, X, X, X, X, X, X],
    ]
    assert batch["document_ids"].dtype == torch.int32
    assert all(batch[k].dtype == torch.long for k in ("input_ids", "labels", "position_ids"))


def test_token_documents_without_labels_fill_rows_and_continue(tmp_path):
    """Rows of plain tokens (no labels) are documents like text: cut at a row's end, continued in the next with
    positions from 0 and no label on the continued part's first token."""
    a, b, c = [10, 11, 12, 13, 14], [20, 21, 22, 23, 24, 25], [30, 31]
    [batch] = batches(tokens_file(tmp_path, [a, b, c]), 8, 2, 1)
    assert batch["input_ids"].tolist() == [a + b[:3], b[3:] + c + [0] * 3]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 0, 1, 0, 0, 0]]
    assert batch["document_ids"].tolist() == [[0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, -1, -1, -1]]
    assert batch["labels"].tolist() == [[X, 11, 12, 13, 14, X, 21, 22], [X, 24, 25, X, 31, X, X, X]]


def test_no_packing_one_example_per_row(tmp_path):
    path = tokens_file(tmp_path, [[10, 11, 12], [20, 21]])
    [batch] = batches(path, 4, 2, 1, pack=False)
    assert batch["input_ids"].tolist() == [[10, 11, 12, 0], [20, 21, 0, 0]]
    assert batch["labels"].tolist() == [[X, 11, 12, X], [X, 21, X, X]]
    assert batch["document_ids"].tolist() == [[0, 0, 0, -1], [0, 0, -1, -1]]


def test_text_documents_fill_rows_and_continue(tmp_path):
    """Text is split at row boundaries; the continued part restarts positions, its first label is -100."""
    path = tmp_path / "c.txt"
    path.write_text("abc\n\ndefgh\n")  # documents: <bos>abc<eos> (5 tokens), <bos>defgh<eos> (7 tokens)
    [batch] = batches(str(path), 8, 2, 1, fmt="text")

    def ids(s):
        return [3 + c for c in s.encode()]

    doc1, doc2 = [1, *ids("abc"), 2], [1, *ids("defgh"), 2]
    assert batch["input_ids"].tolist() == [doc1 + doc2[:3], doc2[3:] + [0] * 4]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 0, 0, 0]]
    assert batch["document_ids"].tolist() == [[0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, -1, -1, -1, -1]]
    assert batch["labels"].tolist() == [[X, *doc1[1:], X, *doc2[1:3]], [X, *doc2[4:], X, X, X, X]]


def test_long_text_document_without_packing_is_chunked(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("abcdefghij\n")  # 12 tokens with bos/eos
    [batch] = batches(str(path), 5, 3, 1, fmt="text", pack=False)
    assert (batch["document_ids"] >= 0).sum(dim=1).tolist() == [5, 5, 2]
    assert batch["labels"][:, 0].tolist() == [X, X, X]


def test_document_attention_mask():
    docs = torch.tensor([[0, 0, 1, 1, 1, -1]], dtype=torch.int)
    mask = document_attention_mask(docs)
    T, O = True, False
    assert mask.shape == (1, 1, 6, 6)
    assert mask[0, 0].tolist() == [
        [T, O, O, O, O, O],
        [T, T, O, O, O, O],
        [O, O, T, O, O, O],
        [O, O, T, T, O, O],
        [O, O, T, T, T, O],
        [O, O, O, O, O, T],  # padding sees only itself, so its softmax row is never empty
    ]


def summed_loss(model, batch):
    """Sum of next-token losses over label tokens, with the document mask and per-document positions."""
    logits = model(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        attention_mask=document_attention_mask(batch["document_ids"]),
    ).logits.float()
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=X, reduction="sum"
    )


def test_packed_loss_equals_unpacked_loss(tmp_path):
    """Packing changes nothing the model computes: attention never crosses a document inside a row."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, 259, (n,), generator=g).tolist() for n in (5, 9, 3, 7, 12, 4)]
    path = tokens_file(tmp_path, rows, labels=True)  # (whole examples: the unpacked rows hold the same ones)
    config = LlamaConfig(
        vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    [packed] = batches(path, 16, 3, 1)  # 3 rows: 5+9, 3+7, 12+4
    [unpacked] = batches(path, 16, 6, 1, pack=False)
    assert (packed["document_ids"].amax(dim=1) > 0).any()  # some row really holds several documents
    assert (packed["labels"] != X).sum() == (unpacked["labels"] != X).sum() == sum(len(r) - 1 for r in rows)
    with torch.no_grad():
        torch.testing.assert_close(
            summed_loss(model, packed), summed_loss(model, unpacked), rtol=1e-5, atol=1e-5
        )
        # and the mask matters: without it, packed documents attend to each other and the loss changes
        no_mask = dict(packed, document_ids=torch.zeros_like(packed["document_ids"]))
        assert abs(summed_loss(model, no_mask) - summed_loss(model, unpacked)) > 1e-3
