"""Loader micro-batches as the engine takes them: next-token targets that never cross a document boundary, and
the tokens the loss counts."""

from __future__ import annotations

import torch

from .data.formats import IGNORE
from .models.loss import loss_rows


def count_targets(micro: list[dict[str, torch.Tensor]]) -> int:
    """Tokens with a target in these prepared micro-batches (the loss's normalizer)."""
    return sum(int((m["targets"] != IGNORE).sum()) for m in micro)


def prepare(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Loader micro-batch -> engine micro-batch: next-token targets, no target across a document boundary."""
    labels, docs = batch["labels"], batch["document_ids"]
    targets = torch.full_like(labels, IGNORE)
    same_doc = docs[:, 1:] == docs[:, :-1]
    targets[:, :-1] = torch.where(same_doc, labels[:, 1:], IGNORE)
    out = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "targets": targets}
    # The tail gathers the tokens that have a target only when at least 1/32 have none: the gather costs a little
    # where every token has a target and saves the logits of every token without one.
    rows = loss_rows(targets)
    if rows.numel() <= targets.numel() * 31 // 32:
        out["loss_rows"] = rows
    # Rows holding one document and no padding need no explicit mask: plain causal attention is exact.
    if bool((docs != docs[:, :1]).any()):
        out["document_ids"] = docs
    return out
