"""The training stream (endless over epochs, exactly resumable) and the fixed validation micro-batches."""

from __future__ import annotations

import hashlib
import math
import random
import warnings
from dataclasses import dataclass

from ..errors import plural
from .config import DataConfig, DataError, check_config
from .formats import CHAT_FORMATS, Example, ExampleSet, load_examples
from .packing import Row, collate, pack_rows, pad_id


def fingerprint(examples: list[Example]) -> str:
    """A short hash of every token and label, so a resume notices that the dataset changed under it."""
    h = hashlib.sha256()
    for ex in examples:
        h.update(len(ex).to_bytes(8, "little"))
        h.update(ex.input_ids.numpy().tobytes())
        h.update(ex.labels.numpy().tobytes())
    return h.hexdigest()[:16]


class Loader:
    """Micro-batches of rows, one epoch after another; each epoch shuffles the examples (by seed and epoch)
    and packs them anew. The position (epoch, index of the next row) is all the state there is."""

    def __init__(
        self,
        examples: list[Example],
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        shuffle: bool,
        pack: bool,
        pad: int,
    ):
        self.examples, self.seq_len, self.micro_batch_size = examples, seq_len, micro_batch_size
        self.seed, self.shuffle, self.pack, self.pad = seed, shuffle, pack, pad
        self.fingerprint = fingerprint(examples)
        self.epoch, self.index = 0, 0
        self._rows_epoch, self._rows = -1, []

    def rows(self, epoch: int) -> list[Row]:
        """The packed rows of an epoch; the current epoch's are cached."""
        if epoch != self._rows_epoch:
            self._rows_epoch, self._rows = epoch, self._pack(epoch)
        return self._rows

    def _pack(self, epoch: int) -> list[Row]:
        order = list(range(len(self.examples)))
        if self.shuffle:
            # `random` hashes a string seed with SHA-512: stable across Python versions and platforms.
            random.Random(f"slide-data:{self.seed}:{epoch}").shuffle(order)
        return pack_rows(self.examples, order, self.seq_len, self.pack)

    @property
    def rows_per_epoch(self) -> int:
        """Rows in the current epoch (it can differ slightly between epochs when packing whole examples)."""
        return len(self.rows(self.epoch))

    def rows_in(self, epochs: float) -> int:
        """Rows in the first `epochs` epochs from the start (a fraction counts that share of the next epoch's
        rows, rounded up). Only packing whole examples in a new order each epoch makes epochs differ; then each
        is packed to count it (about 3 s per million examples on two cores)."""
        whole = int(epochs)
        if self.shuffle and self.pack and not all(ex.splittable for ex in self.examples):
            # (the loader's own epoch through the cache it reads from next, so it is packed once)
            counts = [len(self.rows(e) if e in (self._rows_epoch, self.epoch) else self._pack(e))
                      for e in range(whole + 1)]
        else:
            counts = [self.rows_per_epoch] * (whole + 1)
        # (rounded first: 0.6 * 10 is 6.000000000000001 in floats, which would take a row more)
        return sum(counts[:whole]) + math.ceil(round((epochs - whole) * counts[whole], 6))

    def next_micro_batch(self) -> dict:
        batch: list[Row] = []
        while len(batch) < self.micro_batch_size:
            rows = self.rows(self.epoch)
            batch.append(rows[self.index])
            self.index += 1
            if self.index == len(rows):  # an epoch's last micro-batch continues into the next epoch
                self.epoch, self.index = self.epoch + 1, 0
        return collate(self.examples, batch, self.seq_len, self.pad, self.micro_batch_size)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "fingerprint": self.fingerprint,
                **self._layout()}

    def _layout(self) -> dict:
        """What lays the examples out in rows: the saved row index means another row under other values."""
        return {"seq_len": self.seq_len, "pack": self.pack, "shuffle": self.shuffle}

    def load_state_dict(self, d: dict) -> None:
        if d.get("fingerprint") != self.fingerprint or d.get("seed") != self.seed:
            raise DataError(
                "cannot resume the data position: the dataset, tokenizer, seq_len or seed differ from the "
                f"run that saved it (fingerprint {d.get('fingerprint')} seed {d.get('seed')}, now "
                f"{self.fingerprint} seed {self.seed})"
            )
        # (Checkpoints from before these were saved carry none of them: nothing to compare.)
        changed = {k: (d[k], v) for k, v in self._layout().items() if k in d and d[k] != v}
        if changed:
            was = ", ".join(f"{k}={old} (now {new})" for k, (old, new) in changed.items())
            raise DataError(f"cannot resume the data position: the run that saved it had {was}; resume with the "
                            "same values, or start afresh (--overwrite=true without --resume, or another "
                            "output_dir)")
        epoch, index = int(d["epoch"]), int(d["index"])
        if not 0 <= index < len(self.rows(epoch)):
            raise DataError(f"cannot resume the data position: row {index} is past the end of epoch {epoch}")
        self.epoch, self.index = epoch, index


@dataclass
class TokenData:
    train: Loader
    eval: list[dict] | None  # fixed validation micro-batches
    stats: dict  # counts for the run's start-up summary
    loaded: ExampleSet  # every example as read (for `slide-train data` to show without reading them again)

    def summary(self) -> str:
        s = self.stats
        text = (
            f"data: {s['source']} ({s['format']}): {plural(s['train_examples'], 'train example')}, "
            f"{plural(s['train_tokens'], 'token')} ({s['train_label_tokens']} with loss), "
            f"{plural(self.train.rows_per_epoch, 'row')} of {s['seq_len']} per epoch"
        )
        if self.eval is not None:
            batches = plural(len(self.eval), "micro-batch", "micro-batches")
            text += f"; {plural(s['eval_examples'], 'eval example')} in {batches}"
        if self.loaded.unknown is not None:
            text += f"; {self.loaded.unknown.text()} unknown"
        if s["dropped_pieces"]:
            text += (f"; {plural(s['dropped_pieces'], 'piece')} of rows longer than seq_len dropped (no loss token: "
                     f"{self.loaded.dropped_where(pieces=True)})")
        if s["truncated"] or s["dropped"]:
            text += f"; {s['truncated']} truncated, {s['dropped']} dropped (no loss token"
            text += f": {self.loaded.dropped_where()})" if s["dropped"] else ")"
        return text


def split_eval(n: int, fraction: float, seed: int, source) -> tuple[list[int], list[int]]:
    """(train, eval) example indices: a seeded random `fraction` of examples, at least one, is held out."""
    if fraction == 0.0:
        return list(range(n)), []
    k = max(1, round(fraction * n))
    if k >= n:
        raise DataError(
            f"data.eval_fraction={fraction}: {source} has only {plural(n, 'example')}, too few to hold out {k} "
            "and still train; lower eval_fraction or add data"
        )
    order = list(range(n))
    random.Random(f"slide-eval:{seed}").shuffle(order)
    return sorted(order[k:]), sorted(order[:k])


def build_data(cfg: DataConfig, tokenizer, seq_len: int, micro_batch_size: int, seed: int,
               vocab_size: int | None = None, progress: bool | None = None) -> TokenData:
    check_config(cfg, seq_len, micro_batch_size)
    loaded: ExampleSet = load_examples(cfg, tokenizer, seq_len, vocab_size, progress)
    if loaded.truncated:
        warnings.warn(
            f"{loaded.source}: {loaded.truncated} of {plural(loaded.records, 'example')} "
            f"{'is' if loaded.truncated == 1 else 'are'} longer than seq_len={seq_len} and "
            f"{'was' if loaded.truncated == 1 else 'were'} truncated (their ends are not trained on)",
            stacklevel=2,
        )
    if loaded.dropped:
        hint = "; only assistant turns carry a loss" if cfg.format in CHAT_FORMATS else ""
        warnings.warn(
            f"{loaded.source}: {plural(loaded.dropped, 'example')} "
            f"{'has' if loaded.dropped == 1 else 'have'} no token with a loss and "
            f"{'was' if loaded.dropped == 1 else 'were'} dropped "
            f"({loaded.dropped_where()}){hint}",
            stacklevel=2,
        )
    if loaded.dropped_pieces:
        one = loaded.dropped_pieces == 1
        warnings.warn(
            f"{loaded.source}: rows longer than seq_len={seq_len} are cut into pieces of {seq_len} tokens, each "
            f"piece's first token without a loss; {plural(loaded.dropped_pieces, 'piece')} "
            f"({plural(loaded.dropped_piece_tokens, 'token')} in all) {'has' if one else 'have'} no token with a "
            f"loss left and {'was' if one else 'were'} dropped ({loaded.dropped_where(pieces=True)}); the rest of "
            f"{'its row' if one else 'their rows'} trains",
            stacklevel=2,
        )
    train_idx, eval_idx = split_eval(len(loaded.examples), cfg.eval_fraction, seed, loaded.source)
    pad = pad_id(tokenizer)
    train_examples = [loaded.examples[i] for i in train_idx]
    train = Loader(train_examples, seq_len, micro_batch_size, seed, cfg.shuffle, cfg.pack, pad)
    eval_batches = None
    if eval_idx:
        eval_examples = [loaded.examples[i] for i in eval_idx]
        rows = pack_rows(eval_examples, list(range(len(eval_examples))), seq_len, cfg.pack)
        rows = rows[: cfg.eval_batches * micro_batch_size]
        eval_batches = [
            collate(eval_examples, rows[a : a + micro_batch_size], seq_len, pad, micro_batch_size)
            for a in range(0, len(rows), micro_batch_size)
        ]
    stats = {
        "source": str(loaded.source),
        "format": cfg.format,
        "seq_len": seq_len,
        "records": loaded.records,
        "train_examples": len(train_examples),
        "train_tokens": sum(len(ex) for ex in train_examples),
        "train_label_tokens": sum(int((ex.labels != -100).sum()) for ex in train_examples),
        "eval_examples": len(eval_idx),
        "truncated": loaded.truncated,
        "dropped": loaded.dropped,
        "dropped_pieces": loaded.dropped_pieces,
        "unknown_share": None if loaded.unknown is None else loaded.unknown.share,
    }
    return TokenData(train=train, eval=eval_batches, stats=stats, loaded=loaded)
