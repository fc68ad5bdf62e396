"""Needle-in-a-haystack retrieval in the style of RULER (paper 003, Fig. 5 and Table 4), generated on the fly.

A context of exactly `length` tokens is a haystack (validation text, or the embedded corpus) with needles
"The special magic number for {key} is: {value}." inserted, the target needle at fraction `depth` of the
context, and a question at the end. Kinds:
    single      one needle, asked back
    multikey    the target needle among others with different keys
    multivalue  several needles with the same key; all of their values are asked for
    multiquery  several needles; the values of several keys are asked for, in order
Each example is scored two ways:
    generate  greedy decoding (with the KV cache) must produce every expected value
    rank      each expected value must have a lower NLL than every one of `candidates - 1` distractor
              values of the same length (candidate ranking, eval/ranking.py)
Examples are a pure function of (seed, kind, length, depth, index).
"""

from __future__ import annotations

import random

import numpy as np
import torch
from tqdm import tqdm

from eval.ranking import continuation_logprobs

KINDS = ("single", "multikey", "multivalue", "multiquery")
ADJECTIVES = ["amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "ivory", "jolly",
              "keen", "lucky", "mellow", "noble", "olive", "proud", "quiet", "rusty", "silver", "tidy",
              "vivid", "wild", "young", "zesty"]
NOUNS = ["anchor", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket",
         "kettle", "lantern", "meadow", "needle", "orchid", "pepper", "quarry", "rocket", "saddle", "tunnel",
         "umbrella", "violin", "walrus", "yarrow"]


def needle_text(key: str, value: str) -> str:
    return f" The special magic number for {key} is: {value}. "


def question_text(keys: list[str], kind: str) -> str:
    if kind == "multivalue":
        return f" What are all the special magic numbers for {keys[0]} mentioned in the provided text? " \
               f"The special magic numbers for {keys[0]} mentioned in the provided text are:"
    if kind == "multiquery":
        return f" What are the special magic numbers for {', '.join(keys)} mentioned in the provided text? " \
               "The special magic numbers are:"
    return f" What is the special magic number for {keys[0]} mentioned in the provided text? " \
           f"The special magic number for {keys[0]} is:"


def make_example(tokenizer, haystack: np.ndarray, kind: str, length: int, depth: float, index: int, seed: int,
                 n_needles: int = 4, digits: int = 7, candidates: int = 4) -> dict:
    """One example: context token ids of exactly `length`, expected values, and distractor values."""
    rng = random.Random(f"{seed}/{kind}/{length}/{depth}/{index}")
    keys = rng.sample([f"{a}-{n}" for a in ADJECTIVES for n in NOUNS], n_needles)
    number = lambda: str(rng.randrange(10 ** (digits - 1), 10 ** digits))  # noqa: E731
    if kind == "single":
        needles, asked = [(keys[0], number())], [keys[0]]
    elif kind == "multikey":
        needles, asked = [(k, number()) for k in keys], [keys[0]]
    elif kind == "multivalue":
        needles, asked = [(keys[0], number()) for _ in range(n_needles)], [keys[0]]
    elif kind == "multiquery":
        needles, asked = [(k, number()) for k in keys], keys[:2]
    else:
        raise ValueError(f"unknown niah kind {kind!r}: expected one of {', '.join(KINDS)}")
    expected = [v for k, v in needles if k in asked] if kind != "multiquery" else [dict(needles)[k] for k in asked]
    used = {v for _, v in needles}
    distractors = []
    while len(distractors) < candidates - 1:
        value = number()
        if value not in used:
            used.add(value)
            distractors.append(value)

    needle_ids = [tokenizer.encode(needle_text(k, v)) for k, v in needles]
    question_ids = tokenizer.encode(question_text(asked, kind))
    filler = length - len(question_ids) - sum(map(len, needle_ids))
    if filler < 1:
        raise ValueError(f"niah length {length} is too short for {len(needles)} needles and the question")
    start = rng.randrange(0, max(1, len(haystack) - filler))
    hay = list(haystack[start:start + filler])
    hay += list(np.resize(haystack, filler - len(hay)))  # wrap around for short haystacks
    # the target (first) needle at the requested depth, the others at random places
    slots = [int(round(depth * filler))] + [rng.randrange(0, filler + 1) for _ in needle_ids[1:]]
    pieces, cut = [], 0
    for slot, ids in sorted(zip(slots, needle_ids), key=lambda p: p[0]):
        pieces += hay[cut:slot] + ids
        cut = slot
    context = pieces + hay[cut:] + question_ids
    assert len(context) == length
    return {"id": f"{kind}/L={length}/d={depth}/i={index}", "kind": kind, "length": length, "depth": depth,
            "context": context, "expected": expected, "distractors": distractors}


@torch.no_grad()
def score_examples(model, tokenizer, examples: list[dict], batch_size: int = 8) -> list[dict]:
    """Generate and rank for a list of examples of equal context length."""
    device = next(model.parameters()).device
    records = []
    for start in range(0, len(examples), batch_size):
        batch = examples[start:start + batch_size]
        answer_len = max(len(tokenizer.encode(" " + ", ".join(e["expected"]))) for e in batch) + 2
        x = torch.tensor([e["context"] for e in batch], device=device)
        out = model.generate(x, answer_len, temperature=0, use_cache=True)[:, x.shape[1]:]
        pairs = [(e["context"], tokenizer.encode(" " + value)) for e in batch
                 for value in e["expected"] + e["distractors"]]
        scores = iter(continuation_logprobs(model, pairs, batch_size))
        for e, generated in zip(batch, out.tolist()):
            text = tokenizer.decode(generated)
            nll = {v: -next(scores)["logprob"] for v in e["expected"] + e["distractors"]}
            worst_expected = max(nll[v] for v in e["expected"])
            rank_ok = all(worst_expected < nll[d] for d in e["distractors"])
            gen_ok = all(v in text for v in e["expected"])
            records.append({"id": e["id"], "kind": e["kind"], "length": e["length"], "depth": e["depth"],
                            "correct_generate": gen_ok, "correct_rank": rank_ok, "correct": rank_ok,
                            "generated": text})
    return records


def run(model, tokenizer, haystack: np.ndarray, lengths, depths, kinds, samples: int, seed: int,
        batch_size: int = 8, digits: int = 7, candidates: int = 4, progress: bool = True, needles: int = 4) -> dict:
    """Every (kind, length, depth) cell with `samples` examples: rows of accuracies and per-example records."""
    limit = model.config.block_size if model.wpe is not None else None
    rows, per_example = [], []
    cells = [(k, L, d) for L in lengths for k in kinds for d in depths]
    for kind, length, depth in tqdm(cells, desc="niah", disable=not progress):
        if limit is not None and length > limit:
            rows.append({"kind": kind, "length": length, "depth": depth, "n": 0, "acc_generate": None,
                         "acc_rank": None, "note": f"longer than block_size {limit} (learned positions)"})
            continue
        try:
            examples = [make_example(tokenizer, haystack, kind, length, depth, i, seed, n_needles=needles,
                                     digits=digits, candidates=candidates) for i in range(samples)]
        except ValueError as err:  # the needles and question do not fit: a skipped cell, not a failed run
            rows.append({"kind": kind, "length": length, "depth": depth, "n": 0, "acc_generate": None,
                         "acc_rank": None, "note": str(err)})
            continue
        records = score_examples(model, tokenizer, examples, batch_size)
        per_example += records
        rows.append({"kind": kind, "length": length, "depth": depth, "n": len(records),
                     "acc_generate": float(np.mean([r["correct_generate"] for r in records])),
                     "acc_rank": float(np.mean([r["correct_rank"] for r in records]))})
    return {"rows": rows, "per_example": per_example}
