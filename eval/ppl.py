"""Held-out perplexity at several evaluation lengths (and windows), as in paper 001's Table 2.

The validation tokens are split into documents at the end-of-text token (each document keeps its trailing
end-of-text), or taken as one stream of documents back to back (`stream`, for evaluation lengths beyond the
documents' lengths); every document (or the stream) is cut into non-overlapping windows of the evaluation
length, and every token after the first is predicted exactly once, from the window it falls in. Perplexity is
exp(total NLL / predicted tokens) with both counted exactly.

Alongside the total, each window's mean NLL (the per-example results `scripts/compare.py --paired` pairs
across models scored on the same windows) and the mean NLL at each position of the window (where in the
window a model gains or loses: paper 004's Fig. 5 measured on held-out text, positions taken relative to the
block boundaries at multiples of the block length).

Each cell also says how much text it scored: its tokens, its windows and the standard error of its mean NLL
(windows as the sampling units, the ratio estimator's standard error). A cell of fewer than MIN_WINDOWS windows
is flagged (`few_windows`): its number is noisy, and the evaluation and scripts/compare.py say so.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from attention.ops.shard import Shard
from eval.ranking import length_batches, length_independent
from common.progress import progress_bar

MIN_WINDOWS = 20  # fewer windows in a cell: a noisy number, flagged on screen, in the results and in compare


def nll_stderr(window_nll, window_tokens) -> float | None:
    """Standard error of the mean NLL per token (total NLL / tokens) with windows as the units: the ratio
    estimator's sqrt(k / (k - 1) * sum_i (S_i - nll * n_i)^2) / sum_i n_i, where S_i is window i's total NLL
    and n_i its tokens. None for fewer than two windows."""
    k = len(window_nll)
    if k < 2:
        return None
    n = np.asarray(window_tokens, dtype=np.float64)
    s = np.asarray(window_nll, dtype=np.float64) * n
    mean = s.sum() / n.sum()
    return float(math.sqrt(k / (k - 1) * ((s - mean * n) ** 2).sum()) / n.sum())


def documents(tokens: np.ndarray, eot_id: int, max_tokens: int | None = None) -> list[np.ndarray]:
    """Documents in order (each ending with eot_id, except a trailing unterminated one). With max_tokens below the
    split's size, documents from across the whole split, not its head: every k-th (k: the split's tokens over
    max_tokens, rounded up), the last one cut to the budget."""
    bounds, start = [], 0
    for end in list(np.flatnonzero(tokens == eot_id)) + [len(tokens) - 1]:
        if end >= start:
            bounds.append((start, end + 1))
            start = end + 1
    if max_tokens is not None and len(tokens) > max_tokens:
        bounds = bounds[::-(-len(tokens) // max_tokens)]
    docs, total = [], 0
    for first, end in bounds:
        doc = np.asarray(tokens[first:end], dtype=np.int64)
        if max_tokens is not None:
            doc = doc[:max_tokens - total]  # the budget cuts the last document
        if len(doc) < 2:  # nothing to predict
            continue
        docs.append(doc)
        total += len(doc)
        if max_tokens is not None and total >= max_tokens:
            break
    return docs


def stream(tokens: np.ndarray, max_tokens: int | None = None) -> np.ndarray:
    """The first max_tokens tokens as one sequence, documents back to back with their end-of-text tokens (how
    training windows see them): evaluation lengths are then not capped by the documents' lengths."""
    return np.asarray(tokens[:max_tokens], dtype=np.int64)


def windows(docs: list[np.ndarray], length: int):
    """(inputs, targets) pairs: non-overlapping windows of up to `length` predicted tokens per document."""
    for doc in docs:
        for s in range(0, len(doc) - 1, length):
            chunk = doc[s:s + length + 1]
            yield chunk[:-1], chunk[1:]


@torch.no_grad()
def window_nlls(model, x, y, shards=None):
    """Each target's NLL (batch, width) of windows x against targets y (-1: none, NLL 0). With shards (group, rank,
    P): each process scores its shard of the windows (padded to a multiple of P with targets -1) and the NLLs of
    the group's shards are gathered: n numbers per window travel, never its logits."""
    if shards is None:
        logits, _ = model(x)
        return F.cross_entropy(logits.float().transpose(1, 2), y, ignore_index=-1, reduction="none")
    group, rank, P = shards
    width = x.shape[1]
    pad = -width % P
    x, y = F.pad(x, (0, pad)), F.pad(y, (0, pad), value=-1)
    shard = Shard(group, rank, P, width + pad)
    s, e = shard.bounds()
    logits, _ = model(x, shard=shard)
    nll = F.cross_entropy(logits.float().transpose(1, 2), y[:, s:e], ignore_index=-1, reduction="none")
    return shard.all_gather(nll.contiguous(), "window nll").permute(1, 0, 2).reshape(x.shape[0], -1)[:, :width]


def perplexity(model, docs: list[np.ndarray], length: int, batch_size: int = 8, device="cpu",
               progress: bool = True, limit: int | None = None, shards=None) -> dict:
    """Perplexity of the model over the documents, evaluated in windows of `length` tokens (the first
    `limit` windows when given), with each window's mean NLL (`window_nll`, in window order) and the mean NLL
    at each window position (`nll_by_position`: entry t is over the targets at position t, None where no
    window reaches it). shards (group, rank, P): context parallelism, each window cut over the P processes of
    the group, which all run this with the same arguments and get the same numbers (window_nlls)."""
    pairs = list(windows(docs, length))[:limit]
    window_nll = [0.0] * len(pairs)
    position_nll = torch.zeros(length, dtype=torch.float64)
    position_count = torch.zeros(length, dtype=torch.float64)
    batches = length_batches([len(x) for x, _ in pairs], batch_size, length_independent(model))
    for batch in progress_bar(batches, progress, desc=f"ppl L={length}", leave=False):
        width = max(len(pairs[i][0]) for i in batch)
        x = torch.zeros(len(batch), width, dtype=torch.long)
        y = torch.full((len(batch), width), -1, dtype=torch.long)  # -1: padding, not predicted
        for row, i in enumerate(batch):
            inputs, targets = pairs[i]
            x[row, :len(inputs)] = torch.from_numpy(inputs)
            y[row, :len(targets)] = torch.from_numpy(targets)
        nll = window_nlls(model, x.to(device), y.to(device), shards).double().cpu()  # (batch, width), 0 at padding
        predicted = (y != -1).double()
        for row, i in enumerate(batch):
            window_nll[i] = float(nll[row].sum() / predicted[row].sum())
        position_nll[:width] += nll.sum(0)
        position_count[:width] += predicted.sum(0)
    total_tokens = int(position_count.sum())
    nll = float(position_nll.sum()) / total_tokens
    by_position = [float(t / c) if c else None for t, c in zip(position_nll, position_count)]
    window_tokens = [len(y) for _, y in pairs]
    return {"length": length, "ppl": math.exp(nll), "nll": nll, "nll_stderr": nll_stderr(window_nll, window_tokens),
            "tokens": total_tokens, "windows": len(pairs), "few_windows": len(pairs) < MIN_WINDOWS,
            "window_nll": window_nll, "window_tokens": window_tokens, "nll_by_position": by_position}
