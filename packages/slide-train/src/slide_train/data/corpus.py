"""The built-in corpus: small templated documents with structure a tiny model learns in a minute on a CPU.

`corpus.txt` (package data next to this file) is the output of `python -m slide_train.data.corpus`; the
generator is deterministic, and a test checks that the shipped file equals its output.
"""

from __future__ import annotations

import random
from pathlib import Path

CORPUS_FILE = Path(__file__).with_name("corpus.txt")
N_DOCUMENTS = 2400
SEED = 1234

NAMES = ["Pim", "Dara", "Olo", "Mira", "Tesk", "Varn", "Lulu", "Bex", "Quin", "Sola", "Ravi", "Nell"]
THINGS = ["apples", "stones", "shells", "coins", "pears", "books", "cups", "keys"]
COLORS = ["red", "blue", "green", "yellow", "white", "black", "grey", "orange"]
SIZES = ["tiny", "small", "big", "huge"]
PLACES = ["marsh", "forest", "hill", "river", "cave", "field", "lake", "valley"]
FOODS = ["seeds", "leaves", "fish", "roots", "bugs", "berries", "grass", "moss"]
TIMES = ["day", "night", "morning", "evening"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def _creature(rng: random.Random) -> str:
    """An invented animal name, e.g. 'zorbel': consonant-vowel syllables."""
    syllables = [rng.choice("bdgklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(2, 3))]
    return "".join(syllables) + rng.choice(["", "l", "n", "x"])


def _sums(rng: random.Random) -> str:
    start, step = rng.randint(0, 50), rng.randint(1, 9)
    lines, x = [], start
    for _ in range(rng.randint(4, 8)):
        lines.append(f"{x} + {step} = {x + step}.")
        x += step
    return " ".join(lines)


def _counting(rng: random.Random) -> str:
    start, step, n = rng.randint(0, 30), rng.randint(1, 6), rng.randint(5, 10)
    seq = ", ".join(str(start + i * step) for i in range(n))
    return f"Counting by {step} from {start}: {seq}."


def _story(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    thing = rng.choice(THINGS)
    have, more = rng.randint(1, 9), rng.randint(1, 9)
    text = f"{a} has {have} {thing}. {b} gives {a} {more} {thing}. Now {a} has {have + more} {thing}."
    if rng.random() < 0.5:
        lost = rng.randint(1, have + more)
        text += f" {a} loses {lost}. Then {a} has {have + more - lost} {thing}."
    return text


def _animal(rng: random.Random) -> str:
    name = _creature(rng)
    size, color, place = rng.choice(SIZES), rng.choice(COLORS), rng.choice(PLACES)
    food, time = rng.choice(FOODS), rng.choice(TIMES)
    legs = rng.choice([2, 4, 6, 8])
    return (
        f"The {name} is a {size} {color} animal. It lives in the {place} and eats {food}. "
        f"A {name} has {NUMBER_WORDS[legs]} legs and sleeps in the {time}. "
        f"Where does the {name} live? In the {place}. What does it eat? It eats {food}."
    )


def _days(rng: random.Random) -> str:
    i = rng.randrange(7)
    parts = [f"After {DAYS[(i + k) % 7]} comes {DAYS[(i + k + 1) % 7]}." for k in range(rng.randint(2, 5))]
    return " ".join(parts)


def _letters(rng: random.Random) -> str:
    i = rng.randrange(20)
    letters = "abcdefghijklmnopqrstuvwxyz"
    parts = [f"After {letters[i + k]} comes {letters[i + k + 1]}." for k in range(rng.randint(2, 5))]
    return " ".join(parts)


def _numbers(rng: random.Random) -> str:
    n = rng.randint(0, 10)
    return f"The word for {n} is {NUMBER_WORDS[n]}. {NUMBER_WORDS[n].capitalize()} is written {n}."


KINDS = [_sums, _counting, _story, _animal, _days, _letters, _numbers]


def generate_corpus(n_documents: int = N_DOCUMENTS, seed: int = SEED) -> str:
    """Documents separated by blank lines, the layout that data format `text` reads from .txt files."""
    rng = random.Random(seed)
    return "\n\n".join(rng.choice(KINDS)(rng) for _ in range(n_documents)) + "\n"


def builtin_corpus_path() -> Path:
    return CORPUS_FILE


if __name__ == "__main__":
    CORPUS_FILE.write_text(generate_corpus(), encoding="utf-8")
    print(f"wrote {CORPUS_FILE} ({CORPUS_FILE.stat().st_size} bytes)")
