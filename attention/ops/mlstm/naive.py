"""The mLSTM's reference (xLSTM 7B's cell, attention/mlstm.py): the quadratic form over the whole sequence at once,
O(n^2), which the chunkwise and recurrent forms are held to; and what every form shares, eps and the zero state.
Packed documents' cumulative gates are attention/documents.py's document_cumsum."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attention.documents import document_cumsum

EPS = 1e-6


def zero_state(q, v):
    """The state before the first token: C (B, H, d_qk, d_v), n (B, H, d_qk) and m (B, H, 1), all zero."""
    B, H, _, dk = q.shape
    return (q.new_zeros(B, H, dk, v.shape[-1]), q.new_zeros(B, H, dk), q.new_zeros(B, H, 1))


def quadratic_mlstm(q, k, v, i, f, state=None, eps: float = EPS, starts=None):
    """Reference form over the whole sequence: q, k (B, H, n, d_qk), v (B, H, n, d_v), gate pre-activations
    i, f (B, H, n). state: (C, n, m) before the first token, or None (zeros, m = 0). starts (B, n) bool: the tokens
    that begin a document, before which the state is zero (as if the sequence began there); None: none.
    Returns h (B, H, n, d_v)."""
    C0, n0, m0 = zero_state(q, v) if state is None else state
    length = q.shape[2]
    q = q * q.shape[-1] ** -0.5
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    if starts is None:
        log_f = F.logsigmoid(f).cumsum(-1)  # B_t = sum_{s <= t} log f_s
    else:  # keys of other documents drop out; a restarted document begins from the zero state (m = 0)
        log_f = document_cumsum(F.logsigmoid(f), starts[:, None])  # B_t since the token's document began
        runs = starts.cumsum(-1)[:, None]
        causal = causal & (runs[..., :, None] == runs[..., None, :])
        carry = runs == 0  # the tokens the initial state reaches
    # log weight of key j in h_t: B_t - B_j + i_j; of the initial state: B_t + m_0
    log_weights = torch.where(causal, log_f[..., :, None] - log_f[..., None, :] + i[..., None, :], -torch.inf)
    log_initial = log_f + m0 if starts is None else log_f + torch.where(carry, m0, 0)
    m = torch.maximum(log_weights.amax(-1), log_initial)  # the recurrent stabiliser m_t
    weights = torch.exp(log_weights - m[..., None]) * (q @ k.transpose(-1, -2))
    initial = torch.exp(log_initial - m)[..., None]
    if starts is not None:
        initial = initial * carry[..., None]
    numerator = weights @ v + initial * (q @ C0)
    qn = weights.sum(-1, keepdim=True) + initial * (q @ n0[..., None])
    return numerator / (torch.maximum(qn.abs(), torch.exp(-m)[..., None]) + eps)

