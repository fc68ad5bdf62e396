"""RULER's needle-in-a-haystack subtasks (Hsieh et al. 2024; paper 003's Table 4 and Fig. 5), generated on the fly.

The eight retrieval subtasks of RULER's synthetic.yaml, with its templates, needle and haystack types:

    subtask            haystack  key    value   keys  values per key  keys asked
    niah_single_1      noise     word   number  1     1               1
    niah_single_2      essay     word   number  1     1               1
    niah_single_3      essay     word   uuid    1     1               1
    niah_multikey_1    essay     word   number  4     1               1
    niah_multikey_2    needle    word   number  1     1               1
    niah_multikey_3    needle    uuid   uuid    1     1               1
    niah_multivalue    essay     word   number  1     4               1
    niah_multiquery    essay     word   number  4     1               4

Haystacks: `noise` repeats "The grass is green. ..." one sentence per line; `needle` is made of distractor
needles with other keys, one per line; `essay` is natural text split into sentences (RULER uses Paul Graham's
essays; here the validation split of the evaluated run's data, the embedded corpus, or a local text file).
Needles ("One of the special magic numbers for {key} is: {value}.") go at random lines, or for essays at
sentence boundaries at depths drawn from RULER's 40 depths; `depths` instead puts the first asked needle at
that fraction of the haystack (a depth sweep). The haystack grows (binary search on its size, as RULER does)
until the prompt, ending in RULER's answer prefix, takes at most `length - gen_tokens` tokens.

Scores:
    score (RULER's)  greedy generation of gen_tokens tokens (KV cache), then string_match_all: the share of
                     the expected values that appear in the output, case-insensitively (partial credit for the
                     multi-value and multi-query subtasks); `correct` when all of them appear
    rank (second)    each expected value must have a lower NLL than every one of `candidates - 1` distractor
                     values of its type (candidate ranking, eval/ranking.py), a measure models too small to
                     generate the answer still register
Keys are adjective-noun pairs from this module's lists (RULER draws them from wonderwords' lists). Examples are
a pure function of (seed, subtask, length, depth, index).
"""

from __future__ import annotations

import random
import re
import uuid

import numpy as np
import torch

from eval.ranking import continuation_logprobs, length_batches
from progress import progress_bar

# RULER's synthetic.yaml, retrieval family: haystack, key type, value type, keys, values per key, keys asked
SUBTASKS = {
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 4, 1, 4),
}
KINDS = tuple(SUBTASKS)
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
TEMPLATE = ("Some special magic {type_v} are hidden within the following text. Make sure to memorize it. I will quiz "
            "you about the {type_v} afterwards.\n{context}\nWhat are all the special magic {type_v} for {query} "
            "mentioned in the provided text?")
ANSWER_PREFIX = " The special magic {type_v} for {query} mentioned in the provided text are"
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True))]  # RULER's needle depths (%)
GEN_TOKENS = 128  # RULER's tokens_to_generate for niah
ADJECTIVES = ["amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "ivory", "jolly",
              "keen", "lucky", "mellow", "noble", "olive", "proud", "quiet", "rusty", "silver", "tidy",
              "vivid", "wild", "young", "zesty"]
NOUNS = ["anchor", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket",
         "kettle", "lantern", "meadow", "needle", "orchid", "pepper", "quarry", "rocket", "saddle", "tunnel",
         "umbrella", "violin", "walrus", "yarrow"]
WORDS = [f"{a}-{n}" for a in ADJECTIVES for n in NOUNS]
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def random_item(kind: str, rng: random.Random, digits: int = 7) -> str:
    """A key or value of RULER's types: an adjective-noun word pair, a uuid4, or a number of `digits` digits."""
    if kind == "words":
        return rng.choice(WORDS)
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def prompt_template(expected_values: int) -> str:
    """RULER's prompt for a base model (template, then answer prefix), put in the singular as RULER does when
    one value is expected."""
    template = TEMPLATE + ANSWER_PREFIX
    if expected_values == 1:
        template = template.replace("Some", "a").replace("are all", "is").replace("are", "is")
    return template


def haystack_sentences(text: str) -> list[str]:
    """Natural text as sentences (the essay haystack's units)."""
    return [s for s in SENTENCE_END.split(" ".join(text.split())) if s]


def make_example(tokenizer, essay: list[str], kind: str, length: int, depth: float | None, index: int, seed: int,
                 digits: int = 7, candidates: int = 4, gen_tokens: int = GEN_TOKENS) -> dict:
    """One example: prompt token ids (at most length - gen_tokens), expected values, distractor values."""
    if kind not in SUBTASKS:
        raise ValueError(f"unknown niah subtask {kind!r}: expected one of {', '.join(KINDS)}")
    haystack, type_k, type_v, n_keys, n_values, n_asked = SUBTASKS[kind]
    rng = random.Random(f"{seed}/{kind}/{length}/{depth}/{index}")
    keys = []
    while len(keys) < n_keys:
        key = random_item(type_k, rng, digits)
        keys += [key] if key not in keys else []
    values = [[random_item(type_v, rng, digits) for _ in range(n_values)] for _ in keys]
    type_name = type_v[:-1] if n_asked * n_values == 1 else type_v  # the question's "number" for one value
    needles = [NEEDLE.format(type_v=type_v, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    asked = sorted(rng.sample(range(n_keys), n_asked))
    query = keys[asked[0]] if n_asked == 1 else ", ".join(keys[i] for i in asked[:-1]) + ", and " + keys[asked[-1]]
    expected = [v for i in asked for v in values[i]]
    first_asked = needles.index(NEEDLE.format(type_v=type_v, key=keys[asked[0]], value=values[asked[0]][0]))
    order = list(range(len(needles)))
    rng.shuffle(order)  # RULER shuffles the needles before placing them
    template = prompt_template(n_asked * n_values)

    def prompt(size: int) -> str:
        place = random.Random(f"{seed}/{kind}/{length}/{depth}/{index}/place")
        if haystack == "essay":  # the text again from its start when the context needs more of it
            units = [essay[i % len(essay)] for i in range(size)]
            slots = sorted(int(len(units) * d / 100) for d in place.sample(DEPTHS, len(needles)))
            joiner = " "
        else:
            units = [NOISE] * size if haystack == "noise" else \
                [NEEDLE.format(type_v=type_v, key=distractor_key(place), value=random_item(type_v, place, digits))
                 for _ in range(size)]
            slots = sorted(place.sample(range(size + 1), len(needles)) if size + 1 >= len(needles)
                           else [0] * len(needles))
            joiner = "\n"
        if depth is not None:  # the first asked needle at the requested depth, the others where drawn
            slots[order.index(first_asked)] = int(round(depth * len(units)))
        placed = sorted(zip(slots, range(len(order))))
        pieces, cut = [], 0
        for slot, position in placed:
            pieces += units[cut:slot] + [needles[order[position]]]
            cut = max(cut, slot)
        pieces += units[cut:]
        return template.format(type_v=type_name, context=joiner.join(pieces), query=query)

    def distractor_key(place):  # any key but the example's own
        while True:
            key = random_item(type_k, place, digits)
            if key not in keys:
                return key

    if haystack == "essay" and not essay:
        raise ValueError("the essay haystack is empty: give natural text (niah_haystack)")
    budget = length - gen_tokens
    limit = 1 << 22
    if len(tokenizer.encode(prompt(0))) > budget:
        raise ValueError(f"niah length {length} leaves {budget} tokens for the prompt after {gen_tokens} generated, "
                         f"too few for {kind}'s template and needles")
    low, high = 0, 1
    while high < limit and len(tokenizer.encode(prompt(high))) <= budget:
        low, high = high, min(2 * high, limit)
    if high == limit and len(tokenizer.encode(prompt(high))) <= budget:
        low = high
    while high - low > 1:  # largest haystack that fits, as RULER's binary search
        middle = (low + high) // 2
        low, high = (middle, high) if len(tokenizer.encode(prompt(middle))) <= budget else (low, middle)
    ids = tokenizer.encode(prompt(low))
    used = {v for vs in values for v in vs}
    distractors = []
    while len(distractors) < candidates - 1:
        value = random_item(type_v, rng, digits)
        if value not in used:
            used.add(value)
            distractors.append(value)
    return {"id": f"{kind}/L={length}/d={'ruler' if depth is None else depth}/i={index}", "kind": kind,
            "length": length, "depth": depth, "context": ids, "expected": expected, "distractors": distractors}


def string_match_all(prediction: str, references: list[str]) -> float:
    """RULER's niah metric for one example: the share of references found in the prediction (case-insensitive)."""
    return sum(reference.lower() in prediction.lower() for reference in references) / len(references)


@torch.no_grad()
def score_examples(model, tokenizer, examples: list[dict], batch_size: int = 8, gen_tokens: int = GEN_TOKENS,
                   generate: bool = True) -> list[dict]:
    """RULER's generation score and the candidate-ranking score of each example."""
    device = next(model.parameters()).device
    records = [None] * len(examples)
    for indices in length_batches([len(e["context"]) for e in examples], batch_size, pad=False):
        batch = [examples[i] for i in indices]
        texts = [None] * len(batch)
        if generate:  # equal-length prompts: one batched greedy decode over the KV cache
            x = torch.tensor([e["context"] for e in batch], device=device)
            out = model.generate(x, gen_tokens, temperature=0, use_cache=True)[:, x.shape[1]:]
            texts = [tokenizer.decode(ids) for ids in out.tolist()]
        pairs = [(e["context"], tokenizer.encode(" " + value)) for e in batch
                 for value in e["expected"] + e["distractors"]]
        scores = iter(continuation_logprobs(model, pairs, batch_size))
        for i, e, text in zip(indices, batch, texts):
            nll = {v: -next(scores)["logprob"] for v in e["expected"] + e["distractors"]}
            rank_ok = all(nll[v] < nll[d] for v in e["expected"] for d in e["distractors"])
            score = string_match_all(text, e["expected"]) if text is not None else None
            records[i] = {"id": e["id"], "kind": e["kind"], "length": e["length"], "depth": e["depth"],
                          "score": score, "correct": score == 1.0 if score is not None else rank_ok,
                          "correct_rank": rank_ok, "generated": text}
    return records


def run(model, tokenizer, essay_text: str, lengths, depths, kinds, samples: int, seed: int, batch_size: int = 8,
        digits: int = 7, candidates: int = 4, progress: bool = True, gen_tokens: int = GEN_TOKENS,
        generate: bool = True) -> dict:
    """Every (subtask, length, depth) cell with `samples` examples (depths None: RULER's random placement):
    rows of scores, one "average" row per length over the subtasks (RULER's and paper 003's Table 4 average),
    and per-example records."""
    limit = model.config.block_size if model.wpe is not None else None
    essay = haystack_sentences(essay_text)
    rows, per_example = [], []
    cells = [(k, L, d) for L in lengths for k in kinds for d in (depths or [None])]
    for kind, length, depth in progress_bar(cells, progress, desc="niah"):
        if limit is not None and length > limit:
            rows.append({"kind": kind, "length": length, "depth": depth, "n": 0, "score": None, "acc_rank": None,
                         "note": f"longer than block_size {limit} (learned positions)"})
            continue
        try:
            examples = [make_example(tokenizer, essay, kind, length, depth, i, seed, digits, candidates, gen_tokens)
                        for i in range(samples)]
        except ValueError as err:  # the template and needles do not fit: a skipped cell, not a failed run
            rows.append({"kind": kind, "length": length, "depth": depth, "n": 0, "score": None, "acc_rank": None,
                         "note": str(err)})
            continue
        records = score_examples(model, tokenizer, examples, batch_size, gen_tokens, generate)
        per_example += records
        rows.append({"kind": kind, "length": length, "depth": depth, "n": len(records),
                     "score": float(np.mean([r["score"] for r in records])) if generate else None,
                     "acc_rank": float(np.mean([r["correct_rank"] for r in records]))})
    return {"rows": rows + average_rows(rows), "per_example": per_example}


def average_rows(rows: list[dict]) -> list[dict]:
    """One "average" row per length over the subtasks scored there (when more than one): RULER's average. Also
    recomputed when a later evaluation adds or replaces subtasks at a length (eval/results.py)."""
    out = []
    for length in sorted({r["length"] for r in rows}):
        cell = [r for r in rows if r["length"] == length and r["n"] and r["kind"] != "average"]
        if len({r["kind"] for r in cell}) > 1:
            mean = lambda key: float(np.mean([r[key] for r in cell])) if cell[0][key] is not None else None  # noqa: E731
            out.append({"kind": "average", "length": length, "depth": None, "n": sum(r["n"] for r in cell),
                        "score": mean("score"), "acc_rank": mean("acc_rank")})
    return out
