"""The tail (final norm, lm head, fused loss) on the tokens that have a target, against every token.

A chat or instruction fine-tune gives a prompt's tokens no target. The trainer lists the tokens that have one
(`loss_rows`) and the tail runs the norm and the lm head on those only. This times the tail's forward and
backward, bf16 on the GPU, for a micro-batch of 4096 tokens of the B1 and B8 shapes, with no token and with half
the tokens (the first half of the row, a prompt) without a target, each with and without `loss_rows`:

    python3 benchmarks/tail.py --out $OUT
"""

from __future__ import annotations

import argparse

import common
import torch
from common import timed
from torch import nn

from slide_train.data.formats import IGNORE
from slide_train.models.adapter import Edges
from slide_train.models.loss import loss_rows

SHAPES = {"llama-3.2-1b": (2048, 128256), "llama-3.1-8b": (4096, 128256)}  # hidden size, vocabulary


def time_tail(edges: Edges, hidden: torch.Tensor, batch: dict) -> float:
    """Median seconds of the tail's forward and backward."""
    return timed(lambda: (edges.tail(hidden.detach().requires_grad_(), batch, normalizer=1000.0).backward(),
                          torch.cuda.synchronize()), runs=10)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--tokens", type=int, default=4096)
    a = p.parse_args()
    out = {**common.header("tail"), "device": torch.cuda.get_device_name(), "tokens": a.tokens, "runs": []}
    for name, (hidden_size, vocab) in SHAPES.items():
        torch.manual_seed(0)
        edges = Edges(nn.Embedding(vocab, hidden_size), None, nn.RMSNorm(hidden_size),
                      nn.Linear(hidden_size, vocab, bias=False), None).cuda().bfloat16()
        hidden = torch.randn(1, a.tokens, hidden_size, device="cuda", dtype=torch.bfloat16)
        for untargeted in (0.0, 0.5):
            targets = torch.randint(0, vocab, (1, a.tokens))
            targets[:, : int(a.tokens * untargeted)] = IGNORE
            batch = {"targets": targets.cuda()}
            every = time_tail(edges, hidden, batch)
            batch["loss_rows"] = loss_rows(targets).cuda()
            listed = time_tail(edges, hidden, batch)
            out["runs"].append({"shape": name, "untargeted": untargeted, "every_token_ms": round(every * 1e3, 2),
                                "loss_rows_ms": round(listed * 1e3, 2), "speedup": round(every / listed, 3)})
            print(out["runs"][-1], flush=True)
        del edges, hidden
        torch.cuda.empty_cache()
    common.write_result(out, a.out, f"tail-{out['commit'][:7]}.json")


if __name__ == "__main__":
    main()
