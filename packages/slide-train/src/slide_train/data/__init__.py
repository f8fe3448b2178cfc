"""slide_train.data: datasets tokenized, packed and served as micro-batches.

Files: .jsonl, .json, .parquet, .arrow, a `save_to_disk` folder, or plain text (sources.py). Row layouts
(`data.format`): text, jsonl, alpaca, chat, sharegpt, tokens (formats.py, conversations.py).

    data = build_data(DataConfig(path="chat.jsonl", format="chat"), tokenizer, seq_len=2048,
                      micro_batch_size=4, seed=0)
    batch = data.train.next_micro_batch()  # input_ids, labels, position_ids, document_ids: [4, 2048]

Built-ins that need no download: `builtin_tokenizer()` (bytes) and `builtin_corpus_path()` (corpus.txt).
"""

from .config import FORMATS, ROLES, DataConfig, DataError
from .corpus import builtin_corpus_path
from .formats import IGNORE
from .loader import Loader, TokenData, build_data
from .packing import document_attention_mask
from .render import render_examples
from .tokenizer import builtin_tokenizer

__all__ = [
    "FORMATS",
    "IGNORE",
    "ROLES",
    "DataConfig",
    "DataError",
    "Loader",
    "TokenData",
    "build_data",
    "builtin_corpus_path",
    "builtin_tokenizer",
    "document_attention_mask",
    "render_examples",
]
