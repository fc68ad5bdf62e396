"""The reference of span attention: explicit (n, n) scores under the spans' mask, in float32 or better (O(n^2):
tests and the CPU standing in for CUDA only)."""

from __future__ import annotations

import math

import torch


def span_mask(lo, hi, order, n: int):
    """(..., S, n, n) boolean: row i attends key j when lo[i] <= j < hi[i] (and order[j] <= order[i] when given)."""
    keys = torch.arange(n, device=lo.device)
    mask = (keys >= lo[..., None]) & (keys < hi[..., None])
    if order is not None:
        mask = mask & (order[None, :] <= order[:, None])
    return mask


def span_attention_naive(q, k, v, lo, hi, order=None, slopes=None, offset: float = 0.0, sigmoid: bool = False,
                         docs=None):
    """q (B, H, n, D), k, v (B, H_kv, n, D); lo, hi (S, n) or (B, S, n) with S = 1 or H; slopes (H,) or None: the
    bias slopes[h] (i - j) + offset; docs (B, n) or None: rows attend keys of an equal docs value only. Returns the
    output (q's dtype) and the log-sum-exp (B, H, n) float32 (+inf for rows with no key; zeros for sigmoid, which
    has none)."""
    B, H, n, D = q.shape
    compute = torch.promote_types(q.dtype, torch.float32)
    group = H // k.shape[1]
    k, v = (t.to(compute).repeat_interleave(group, dim=1) for t in (k, v))
    scores = q.to(compute) @ k.transpose(-1, -2) / math.sqrt(D)
    if slopes is not None:
        rows = torch.arange(n, device=q.device)
        scores = scores + slopes.to(compute)[:, None, None] * (rows[:, None] - rows[None, :]) + offset
    mask = span_mask(lo.long(), hi.long(), None if order is None else order.long(), n)
    mask = mask if mask.dim() == 4 else mask[None]
    if docs is not None:
        mask = mask & (docs[:, :, None] == docs[:, None, :])[:, None]
    if sigmoid:
        out = (torch.sigmoid(scores) * mask) @ v
        return out.to(q.dtype), torch.zeros(B, H, n, device=q.device, dtype=torch.float32)
    scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, -1)
    has_key = mask.any(-1)
    probs = torch.where(has_key[..., None], torch.exp(scores - lse[..., None]), 0.0)
    lse = torch.where(has_key, lse, math.inf)
    return (probs @ v).to(q.dtype), lse.float()
