"""The mLSTM's cell (xLSTM 7B's, stated in attention/mlstm.py) on the recurrence core (attention/ops/recurrence):
its gates as the core takes them, and its normalised read."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attention.ops.recurrence import Gates, recurrence

EPS = 1e-6


def mlstm_cell(q, k, v, i, f, state=None, chunk: int = 64, eps: float = EPS, starts=None, form: str = "chunked",
               return_stats: bool = False, shard=None):
    """h (B, H, n, d_v) of q, k (B, H, n, d_qk), v (B, H, n, d_v) and the gate pre-activations i, f (B, H, n):
    the core's stabilised recurrence with log decay log sigmoid(f) and log write weight i, over v with a column of
    ones appended (the normaliser n is that column's state), read as C q~ / (max(|n . q~|, exp(-m)) + eps) with
    q~ = q / sqrt(d_qk).

    state: the core's State (C and n as one matrix, divided by exp(m), and m) before the first token, or None
    (zeros, m = 0). starts (B, n) bool: the tokens that begin a document, before which the state is zero (as if
    the sequence began there); None: none. form: chunked (training and prompts: chunks of `chunk` tokens), step
    (generation) or parallel (the O(n^2) reference). Returns h and the state after the last token; with
    return_stats also each position's denominator max(|n . q~|, exp(-m)) and stabiliser m, (B, H, n) each (what
    mlstm_kernels' forward returns as vecN_out and vecM_out)."""
    q = q * q.shape[-1] ** -0.5
    gates = Gates(log_decay=F.logsigmoid(f), log_gain=i, stabilised=True)
    values = torch.cat([v, torch.ones_like(v[..., :1])], -1)
    reads, m, state = recurrence(form, q, k, values, gates, state, starts, chunk=chunk, shard=shard)
    numerator, qn = reads[..., :-1], reads[..., -1:]
    denominator = torch.maximum(qn.abs(), torch.exp(-m)[..., None])
    h = numerator / (denominator + eps)
    if return_stats:
        return h, state, (denominator[..., 0], m)
    return h, state
