"""
The facts corpus: the embedded corpus's text with facts stated and asked back at every distance, so that a
small model learns to retrieve (paper 004's diagnostics at CPU scale; eval/diagnostics.py asks the same kinds).

Each document is an embedded-corpus document (data/embedded.py) cut into lines, with 2-6 facts stated between
them, in the embedded notes' forms:

    The code of the red box is 417.                      asked back as   What is the code of the red box? It is 417.
    Mia keeps the lamp in the blue jar.                  asked back as   Where does Mia keep the lamp? In the blue jar.
                                                         or repeated:    Mia keeps the lamp in the blue jar.

and each fact asked back once, somewhere after its statement, so the distance between a fact and its question
runs from a line to the whole document. Output is a pure function of (seed, document index), drawing only
from random() as the embedded corpus does.
"""

import random
from typing import Iterator

from data import embedded
from data.embedded import COLORS, CONTAINERS, NAMES, THINGS, pick, randint

DEFAULT_NUM_DOCS = 6000


def fact(rng):
    color, container = pick(rng, COLORS), pick(rng, CONTAINERS)
    if rng.random() < 0.5:
        code = randint(rng, 100, 999)
        return (f"The code of the {color} {container} is {code}.",
                f"What is the code of the {color} {container}? It is {code}.")
    keeper, thing = pick(rng, NAMES)[0], pick(rng, THINGS)
    statement = f"{keeper} keeps the {thing} in the {color} {container}."
    question = f"Where does {keeper} keep the {thing}? In the {color} {container}."
    return statement, question if rng.random() < 0.7 else statement


def document(seed: int, index: int) -> str:
    rng = random.Random(seed * 2**32 + index + 1)
    lines = [line for line in embedded.document(seed, index).split("\n") if line.strip()]
    lines += [line for line in embedded.document(seed + 1, index).split("\n") if line.strip()]
    for statement, question in (fact(rng) for _ in range(randint(rng, 2, 6))):
        said = randint(rng, 0, len(lines))
        lines.insert(said, statement)
        lines.insert(randint(rng, said + 1, len(lines)), question)
    return "\n".join(lines)


def documents(num_docs: int = DEFAULT_NUM_DOCS, seed: int = 0) -> Iterator[str]:
    """Yield num_docs documents; the same seed gives the same text."""
    for index in range(num_docs):
        yield document(seed, index)


if __name__ == "__main__":
    for text in documents(num_docs=2):
        print(text, end="\n\n----\n\n")
