"""Packing examples into rows of seq_len tokens, and rows into micro-batch tensors.

A row holds pieces of examples; each piece is its own attention document: position_ids restart at 0 and
document_ids count pieces within the row, so the trainer's mask never lets attention cross a piece boundary.
Packing is next-fit in the given order: an example that does not fit in the row's free space starts a new row
(the rest is padding), except splittable ones (plain text), which fill the row and continue in the next.
"""

from __future__ import annotations

import torch

from .formats import IGNORE, Example

Piece = tuple[int, int, int]  # (example index, start, end): tokens example[start:end]
Row = list[Piece]


def pack_rows(examples: list[Example], order: list[int], seq_len: int, pack: bool) -> list[Row]:
    rows: list[Row] = []
    row: Row = []
    free = seq_len
    for i in order:
        ex, start = examples[i], 0
        while start < len(ex):
            take = min(len(ex) - start, seq_len)
            if pack and take > free:
                if ex.splittable:
                    take = free
                else:
                    rows.append(row)
                    row, free = [], seq_len
            row.append((i, start, start + take))
            start += take
            free -= take
            if free == 0 or not pack:
                rows.append(row)
                row, free = [], seq_len
    if row:
        rows.append(row)
    return rows


def pad_id(tokenizer) -> int:
    """The id written at padding positions (their labels are -100, so only its embedding lookup sees it)."""
    if tokenizer is None:  # format `tokens` may run without a tokenizer
        return 0
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return candidate
    return 0


def collate(examples: list[Example], rows: list[Row], seq_len: int, pad: int, batch_size: int) -> dict:
    """Tensors [batch_size, seq_len]; rows beyond len(rows) are all padding (document_ids -1, labels -100)."""
    input_ids = torch.full((batch_size, seq_len), pad, dtype=torch.long)
    labels = torch.full((batch_size, seq_len), IGNORE, dtype=torch.long)
    position_ids = torch.zeros((batch_size, seq_len), dtype=torch.long)
    document_ids = torch.full((batch_size, seq_len), -1, dtype=torch.int)
    for b, row in enumerate(rows):
        t = 0
        for doc, (i, start, end) in enumerate(row):
            n = end - start
            input_ids[b, t : t + n] = examples[i].input_ids[start:end]
            labels[b, t : t + n] = examples[i].labels[start:end]
            labels[b, t] = IGNORE  # a continued piece's first token: its predecessor is in another document
            position_ids[b, t : t + n] = torch.arange(n)
            document_ids[b, t : t + n] = doc
            t += n
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "document_ids": document_ids,
    }


def document_attention_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Boolean [B, 1, S, S], True where query t may attend key s: causal and within one document.

    A padding position (document -1) attends only to itself, so no softmax row is empty (that would give NaN).
    """
    s = document_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]
    is_pad = document_ids[:, :, None] < 0
    eye = torch.eye(s, dtype=torch.bool, device=document_ids.device)
    return (causal & same & ~is_pad | is_pad & eye)[:, None]
