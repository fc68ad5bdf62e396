"""
The recall corpus: associative recall over a distance, generated on the fly (no download).

A document states a few key-value pairs, then a long stretch of filler, then asks for one key's value:

    #c=Q k=D|4071938265...1843?k=D

Keys are distinct lowercase letters, values uppercase letters, the filler random digits. The filler is long
enough (`min_filler`, 100 by default) that the pairs lie beyond the receptive field of a small sliding-window
model (layers x window, e.g. 4 x 16 = 64 positions): only a mixer that moves information further, such as
full or stochastic attention, can answer above chance (1/26).

The training data is many such documents (`python data/prepare.py --dataset=recall`, or automatically on
first use of data/recall_byte); the `recall` evaluation task (eval/recall.py) draws fresh ones from another
seed and scores the answer letter. Output is a pure function of (seed, document index), as for the embedded
corpus.
"""

import random
import string
from typing import Iterator

DEFAULT_NUM_DOCS = 20000
KEYS = string.ascii_lowercase[:16]
VALUES = string.ascii_uppercase
QUERY = "?"


def document_parts(seed: int, index: int, pairs: int = 1, min_filler: int = 70, max_filler: int = 90):
    """(context, answer): the document up to and including the query's '=', and the value it asks for."""
    rng = random.Random(seed * 1_000_003 + index)
    keys = rng.sample(KEYS, pairs)
    values = [rng.choice(VALUES) for _ in keys]
    asked = rng.randrange(pairs)
    first = rng.randrange(10)  # the filler counts through the digits: predictable, so that once it is learnt
    filler = "".join(string.digits[(first + i) % 10] for i in range(rng.randint(min_filler, max_filler)))
    stated = " ".join(f"{k}={v}" for k, v in zip(keys, values))
    return f"#{stated}|{filler}{QUERY}{keys[asked]}=", values[asked]


def document(seed: int, index: int, **options) -> str:
    context, answer = document_parts(seed, index, **options)
    return context + answer


def documents(num_docs: int = DEFAULT_NUM_DOCS, seed: int = 0, **options) -> Iterator[str]:
    """Yield num_docs recall documents; the same seed gives the same text."""
    for index in range(num_docs):
        yield document(seed, index, **options)


if __name__ == "__main__":
    for text in documents(num_docs=3):
        print(text)
