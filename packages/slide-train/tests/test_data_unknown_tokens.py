"""A tokenizer is judged on the run's own data: a domain vocabulary (words w0..w399), a CJK-only one and a DNA one
each train on their own data and are refused on English, where most of what they make is unknown; a noticeable
share warns; data.allow_unknown_tokens goes on anyway; a tokenizer of special tokens alone has no vocabulary.

Each expected share is counted here from the vocabularies themselves: which words or characters they hold."""

from __future__ import annotations

import random
import re
import warnings

import pytest
import torch
import transformers
from conftest import tiny_config
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from slide_train.cli import main
from slide_train.data import DataConfig, DataError, build_data

WORDS = [f"w{i}" for i in range(400)]
CJK = [chr(0x4E00 + i) for i in range(300)]
BASES = "ACGTN"
ENGLISH = ["The quick brown fox jumps over the lazy dog.", "A stitch in time saves nine, they said.",
           "Rain fell on the quiet town all night long."]


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Word level over WORDS, with an unknown token: what a domain vocabulary trained on such words gives."""
    vocab = {"[UNK]": 0, "<pad>": 1, "<eos>": 2, **{w: 3 + i for i, w in enumerate(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="<eos>", pad_token="<pad>")


def cjk_tokenizer() -> PreTrainedTokenizerFast:
    """One token per CJK character and no unknown token: characters outside it are left out of the encoding."""
    vocab = {"<pad>": 0, "<eos>": 1, **{c: 2 + i for i, c in enumerate(CJK)}}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>")


def dna_tokenizer() -> PreTrainedTokenizerFast:
    """A, C, G, T, N and an unknown token for every other character."""
    vocab = {"<unk>": 0, "<pad>": 1, "<eos>": 2, **{c: 3 + i for i, c in enumerate(BASES)}}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>", pad_token="<pad>")


def save_model(directory, tokenizer) -> str:
    """A tiny Llama whose vocabulary holds the tokenizer's, saved with it as a local HF model directory; the
    tokenizer is the one loaded back from there."""
    torch.manual_seed(0)
    config = tiny_config("llama")
    config.vocab_size = 512
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def documents(path, docs: list[str]) -> str:
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return str(path)


def word_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(n)]


def cjk_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(CJK) for _ in range(20)) for _ in range(n)]


def dna_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(BASES) for _ in range(60)) for _ in range(n)]


def load(tmp_path, tokenizer, docs, **data):
    """build_data over `docs` as a text file, with the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = build_data(DataConfig(path=documents(tmp_path / "docs.txt", docs), **data), tokenizer, 64, 2, 0)
    return built, [str(w.message) for w in caught]


def english_share_for_words() -> float:
    """Every English word and punctuation mark is one unknown word (Whitespace splits them apart)."""
    return 1.0


def english_share_for_dna(docs: list[str]) -> float:
    """One token per character (no merges): those outside the five bases are unknown."""
    chars = "".join(docs)
    return sum(c not in BASES for c in chars) / len(chars)


CASES = {  # tokenizer, its own data, the share of its tokens unknown on ENGLISH
    "words": (word_tokenizer, word_docs, english_share_for_words()),
    "cjk": (cjk_tokenizer, cjk_docs, 1.0),  # nothing English is encoded: every character is lost
    "dna": (dna_tokenizer, dna_docs, english_share_for_dna(ENGLISH)),
}


@pytest.mark.parametrize("case", CASES)
def test_a_tokenizer_trains_on_its_own_data_without_a_warning(tmp_path, case):
    make, docs, _ = CASES[case]
    tokenizer = transformers.AutoTokenizer.from_pretrained(save_model(tmp_path / "model", make()))
    data, caught = load(tmp_path, tokenizer, docs(40))
    assert not [w for w in caught if "unknown" in w], caught
    assert data.stats["unknown_share"] == 0.0
    assert data.stats["train_examples"] == 40 and data.stats["train_tokens"] > 40 * 12
    assert "0.0% of the tokens of the first 40 examples unknown" in data.summary()


@pytest.mark.parametrize("case", CASES)
def test_a_tokenizer_is_refused_on_english_with_the_share_and_rows(tmp_path, case):
    make, _, share = CASES[case]
    assert share > 0.5
    tokenizer = transformers.AutoTokenizer.from_pretrained(save_model(tmp_path / "model", make()))
    with pytest.raises(DataError) as refused:
        load(tmp_path, tokenizer, ENGLISH)
    message = str(refused.value)
    assert "\n" not in message
    assert f"{share:.1%} of the tokens of the first 3 examples are unknown to" in message
    assert "docs.txt:1: " in message and "docs.txt:3: " in message  # (the rows, each with what it became)
    assert "set data.allow_unknown_tokens: true" in message
    # ... and allowed, the same data loads, with the warning (where the tokenizer made any token of it at all)
    if case == "cjk":
        with pytest.raises(DataError, match="yields no tokens to train on"):
            load(tmp_path, tokenizer, ENGLISH, allow_unknown_tokens=True)
        return
    data, caught = load(tmp_path, tokenizer, ENGLISH, allow_unknown_tokens=True)
    assert data.stats["unknown_share"] == pytest.approx(share)
    assert [w for w in caught if f"{share:.1%} of the tokens" in w and "docs.txt:1: " in w]


def test_the_dna_tokenizer_on_english_counts_each_unknown_character(tmp_path):
    """97.5% of the issue's case: only a few capitals (T, A) and N of English are bases."""
    data, _ = load(tmp_path, dna_tokenizer(), ENGLISH, allow_unknown_tokens=True)
    chars = "".join(ENGLISH)
    assert data.stats["unknown_share"] == pytest.approx(1 - sum(c in BASES for c in chars) / len(chars))
    assert data.stats["unknown_share"] > 0.9


def test_a_noticeable_share_warns_and_trains(tmp_path):
    """One English word in every five: 20% unknown, above the warning's 5% and below the refusal's 50%."""
    rng = random.Random(1)
    docs = [" ".join(rng.choice(WORDS) if k % 5 else rng.choice(["cat", "dog", "tree"]) for k in range(10))
            for _ in range(30)]
    data, caught = load(tmp_path, word_tokenizer(), docs)
    assert data.stats["unknown_share"] == pytest.approx(0.2)
    assert data.stats["train_examples"] == 30
    (warning,) = [w for w in caught if "unknown" in w]
    assert "20.0% of the tokens of the first 30 examples are unknown" in warning
    assert re.search(r"docs\.txt:\d+: 2 of 10 tokens unknown, 'cat|dog|tree", warning)


def test_a_tokenizer_without_an_unknown_token_counts_the_characters_it_drops(tmp_path):
    """CJK text with one Latin letter in five characters: the letters are dropped, each counted unknown."""
    rng = random.Random(2)
    docs = ["".join(rng.choice(CJK) if k % 5 else rng.choice("abc") for k in range(20)) for _ in range(10)]
    data, caught = load(tmp_path, cjk_tokenizer(), docs)
    assert data.stats["unknown_share"] == pytest.approx(0.2)  # 4 lost of 16 tokens + 4 lost, per document
    assert [w for w in caught if "4 characters lost" in w]


def test_only_the_first_thousand_examples_are_measured(tmp_path):
    """1,000 DNA documents, then English ones: the share is that of the first 1,000, and the run goes on."""
    data, caught = load(tmp_path, dna_tokenizer(), dna_docs(1000) + ENGLISH * 100)
    assert data.stats["unknown_share"] == 0.0 and data.stats["train_examples"] == 1300
    assert "0.0% of the tokens of the first 1,000 examples unknown" in data.summary()


def test_token_rows_are_not_measured(tmp_path):
    rows = tmp_path / "t.jsonl"
    rows.write_text('{"input_ids": [0, 0, 0, 0, 5]}\n')  # all <unk> ids of the DNA tokenizer
    data = build_data(DataConfig(path=str(rows), format="tokens"), dna_tokenizer(), 64, 1, 0)
    assert data.stats["unknown_share"] is None and "unknown" not in data.summary()


def test_a_tokenizer_of_special_tokens_only_has_no_vocabulary(tmp_path):
    core = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "<eos>": 1}, unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>")
    with pytest.raises(DataError, match=r"has no vocabulary \(its 2 tokens are all special: <unk> <eos>\)"):
        load(tmp_path, tokenizer, ["ACGT"])
    # one ordinary entry is a vocabulary: the data decides
    core = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "<eos>": 1, "ACGT": 2}, unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>")
    assert load(tmp_path, tokenizer, ["ACGT"])[0].stats["unknown_share"] == 0.0


def test_the_data_command_prints_the_share_and_finetune_goes_on_when_allowed(tmp_path, capsys):
    model = save_model(tmp_path / "model", dna_tokenizer())
    text = documents(tmp_path / "english.txt", ENGLISH * 4)
    share = f"{english_share_for_dna(ENGLISH):.1%}"
    args = [f"--model={model}", f"--data.path={text}", "--seq_len=32", "--micro_batch_size=2", "--grad_accum=1",
            "--steps=1", "--export=false", "--engine.device=cpu", f"--output_dir={tmp_path / 'run'}"]
    assert main(["data", *args]) == 2
    err = capsys.readouterr().err
    assert f"{share} of the tokens of the first 12 examples are unknown" in err
    assert "data.allow_unknown_tokens: true" in err
    assert main(["finetune", *args]) == 2 and not (tmp_path / "run" / "metrics.jsonl").exists()
    capsys.readouterr()
    own = documents(tmp_path / "dna.txt", dna_docs(12))
    assert main(["data", *args, f"--data.path={own}"]) == 0
    assert "0.0% of the tokens of the first 12 examples unknown" in capsys.readouterr().out
    assert main(["finetune", *args, "--data.allow_unknown_tokens=true"]) == 0
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count('"step"') == 1
