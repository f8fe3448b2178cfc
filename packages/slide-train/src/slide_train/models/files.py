"""A model directory's files besides its config and weights: the generation config, the tokenizer's files and the
chat templates; which of them a directory holds, byte copies of them, and the error for a missing tokenizer."""

from __future__ import annotations

import pathlib
import shutil

from ..errors import ModelError

# What a user loads from a model directory besides its config and weights: the generation defaults (stop tokens,
# sampling), the tokenizer (the files of every tokenizer kind transformers reads) and the chat template, which
# lives in tokenizer_config.json, chat_template.jinja, chat_template.json or additional_chat_templates/.
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "merges.txt",
                   "vocab.txt", "tokenizer.tiktoken")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
CHAT_TEMPLATE_DIR = "additional_chat_templates"


def tokenizer_files(model_dir: pathlib.Path) -> list[str]:
    """The tokenizer files present in a model directory, of those transformers reads."""
    return [name for name in TOKENIZER_FILES if (model_dir / name).is_file()]


def no_tokenizer_files(model_dir: pathlib.Path, fmt: str | None = None) -> ModelError:
    """The error for a model directory without a tokenizer. transformers may build an empty one there instead of
    failing, which turns every document into unknown tokens, so the files are looked for first."""
    needs = f"data.format={fmt}" if fmt else "training on text"
    return ModelError(
        f"model {model_dir} has no tokenizer files (looked for {', '.join(TOKENIZER_FILES)}): {needs} needs the "
        "model's tokenizer; copy its tokenizer files next to config.json, or give pre-tokenized rows with "
        "data.format=tokens")


def model_files(source: pathlib.Path, tokenizer=None) -> list[str]:
    """The files of model directory `source` that an export carries over, as paths under it: the generation
    config, the tokenizer's files (with those its class names, `tokenizer`'s if given) and the chat templates."""
    names = [GENERATION_CONFIG, *TOKENIZER_FILES, *CHAT_TEMPLATE_FILES,
             *(n for n in getattr(tokenizer, "vocab_files_names", {}).values() if isinstance(n, str))]
    found = [n for n in dict.fromkeys(names) if (source / n).is_file()]
    templates = source / CHAT_TEMPLATE_DIR
    return found + sorted(f"{CHAT_TEMPLATE_DIR}/{p.name}" for p in templates.glob("*.jinja") if p.is_file())


def copy_model_files(source: pathlib.Path, dest: pathlib.Path, tokenizer=None) -> None:
    """Make `dest`'s carried-over files byte copies of `source`'s: ones `source` lacks (written by a tokenizer's
    `save_pretrained`, say) are removed, so that `dest` loads as `source` does."""
    carried = model_files(source, tokenizer)
    for name in model_files(dest, tokenizer):
        if name not in carried:
            (dest / name).unlink()
    for name in carried:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / name, dest / name)
