"""
The recall corpus: associative recall over a distance, generated on the fly (no download).

A document states key-value pairs (one by default), then a long stretch of filler, then asks for one key's
value after the answer marker '>':

    #c=Q k=D|4567890123...0123?k>D

Keys are distinct lowercase letters, values uppercase letters, the filler digits counting up (predictable,
so it costs little to learn). The filler is long enough (`min_filler`, 60 by default: the value lies 64 or
more positions before the answer) that the pairs lie beyond the receptive field of a small sliding-window
model (layers x (window - 1), e.g. 4 x 15 = 60 positions): only a mixer that moves information further, such
as full or stochastic attention, can answer above chance (1/26). Training on the answers alone
(`--loss_after='>'`) gives the task its whole gradient.

The `recall_near` corpus (`near_documents`) draws the filler from 0 to 100 digits instead: the value lies 5 to
105 positions before the answer, so in a model of fixed blocks (paper 004, b = 64) some questions sit in the
value's block and others in the next one, right after a boundary, where only attention that crosses it (a
bridge, a sliding window, full attention) can answer.

The training data is many such documents (`python -m data.prepare --dataset=recall`, or automatically on
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
ANSWER = ">"  # the answer marker: the value is the token after it


def document_parts(seed: int, index: int, pairs: int = 1, min_filler: int = 60, max_filler: int = 80):
    """(context, answer): the document up to and including the answer marker, and the value it asks for."""
    rng = random.Random(seed * 1_000_003 + index)
    keys = rng.sample(KEYS, pairs)
    values = [rng.choice(VALUES) for _ in keys]
    asked = rng.randrange(pairs)
    first = rng.randrange(10)
    filler = "".join(string.digits[(first + i) % 10] for i in range(rng.randint(min_filler, max_filler)))
    stated = " ".join(f"{k}={v}" for k, v in zip(keys, values))
    return f"#{stated}|{filler}{QUERY}{keys[asked]}{ANSWER}", values[asked]


def document(seed: int, index: int, **options) -> str:
    context, answer = document_parts(seed, index, **options)
    return context + answer


def documents(num_docs: int = DEFAULT_NUM_DOCS, seed: int = 0, **options) -> Iterator[str]:
    """Yield num_docs recall documents; the same seed gives the same text."""
    for index in range(num_docs):
        yield document(seed, index, **options)


NEAR_FILLER = (0, 100)


def near_documents(num_docs: int = 4 * DEFAULT_NUM_DOCS, seed: int = 0) -> Iterator[str]:
    """The recall_near corpus: short documents, the value 5-105 positions before the answer."""
    yield from documents(num_docs, seed, min_filler=NEAR_FILLER[0], max_filler=NEAR_FILLER[1])


if __name__ == "__main__":
    for text in documents(num_docs=3):
        print(text)
