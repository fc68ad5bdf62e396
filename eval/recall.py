"""Associative recall over a distance (the corpus of data/recall.py), scored on fresh documents.

Each context holds exactly `length` tokens: earlier recall documents (as in a training window), then one
document up to its answer marker '>'. The prediction is the value letter with the highest logit at the last
position; chance is 1/26. Every example's correctness is kept, so runs can be compared pairwise
(eval/stats.py) on the same examples.
"""

from __future__ import annotations

import math

import torch

from data.recall import VALUES, document, document_parts
from common.progress import progress_bar

EVAL_SEED_OFFSET = 1_000  # evaluation documents come from seeds the training corpus (seed 0) never uses


def contexts(tokenizer, eot_id: int, length: int, samples: int, seed: int, **options):
    """[(context token ids of exactly `length`, answer letter)] for `samples` fresh documents."""
    seed += EVAL_SEED_OFFSET
    out = []
    for i in range(samples):
        context, answer = document_parts(seed, i, **options)
        ids = tokenizer.encode(context)
        filler, j = [], 0
        while len(filler) + len(ids) < length:  # preceding documents, each followed by end-of-text
            filler = tokenizer.encode(document(seed + 1, samples * j + i, **options)) + [eot_id] + filler
            j += 1
        ids = (filler + ids)[-length:]
        out.append((ids, answer))
    return out


@torch.no_grad()
def accuracy(model, tokenizer, eot_id: int, length: int, samples: int, seed: int, batch_size: int, device,
             progress: bool = True, **options) -> dict:
    letter_ids = torch.tensor([tokenizer.encode(v)[0] for v in VALUES], device=device)
    examples = contexts(tokenizer, eot_id, length, samples, seed, **options)
    correct = []
    for start in progress_bar(range(0, len(examples), batch_size), progress, desc=f"recall L={length}", leave=False):
        batch = examples[start:start + batch_size]
        idx = torch.tensor([ids for ids, _ in batch], device=device)
        logits, _ = model(idx)
        guess = logits[:, -1, letter_ids].argmax(-1).tolist()
        correct += [VALUES[g] == answer for g, (_, answer) in zip(guess, batch)]
    acc = sum(correct) / len(correct)
    return {"length": length, "n": len(correct), "accuracy": acc,
            "stderr": math.sqrt(acc * (1 - acc) / len(correct)), "chance": 1 / len(VALUES),
            "correct": correct}
