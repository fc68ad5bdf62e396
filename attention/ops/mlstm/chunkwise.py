"""The mLSTM's chunkwise form, O(n): the quadratic form inside chunks, the recurrence between them: training and
prompts (and the computation of the Triton kernel's CPU stand-ins, op.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attention.documents import document_cumsum
from attention.ops.mlstm.naive import EPS, zero_state

# an input-gate pre-activation for padding positions: they add nothing to the state (exp underflows to 0)
# and, with log f = 0, leave C, n and m as they were; finite so that no inf - inf appears
NO_INPUT = -1e30


def chunkwise_mlstm(q, k, v, i, f, state=None, chunk: int = 64, eps: float = EPS, return_stats: bool = False,
                    starts=None):
    """O(n) training form: the quadratic form inside chunks of `chunk` tokens, the recurrence between them.

    starts (B, n) bool: the tokens that begin a document, before which the state is zero (as if the sequence
    began there); None: none. Returns h (B, H, n, d_v) and the state (C, n, m) after the last token; with
    return_stats also each position's denominator max(|n . q~|, exp(-m)) and stabiliser m, (B, H, n) each (what
    mlstm_kernels' forward returns as vecN_out and vecM_out). Memory is O(n * chunk): the chunk states are
    computed by a scan over chunks, then every chunk's outputs in one batched pass.
    """
    B, H, length, dk = q.shape
    pad = -length % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        i = F.pad(i, (0, pad), value=NO_INPUT)
        f = F.pad(f, (0, pad), value=torch.inf)  # log sigmoid(inf) = 0: no decay
    nc = (length + pad) // chunk
    q = q * dk ** -0.5
    qc, kc, vc = (t.reshape(B, H, nc, chunk, -1) for t in (q, k, v))
    ic = i.reshape(B, H, nc, chunk)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    keeps = [None] * nc
    if starts is None:
        log_f = F.logsigmoid(f).reshape(B, H, nc, chunk).cumsum(-1)  # b_t within each chunk
    else:
        # exact masks inside each chunk, no gate forced to -inf: b_t counts from the token's document's start,
        # the keys of other documents drop out, and a chunk holding a start hands on its last document alone,
        # begun from the zero state (m = 0)
        starts = F.pad(starts, (0, pad)).view(B, 1, nc, chunk)
        log_f = document_cumsum(F.logsigmoid(f).reshape(B, H, nc, chunk), starts)
        runs = starts.cumsum(-1)  # equal within one document
        causal = causal & (runs[..., :, None] == runs[..., None, :])
        carry = runs == 0  # the tokens the state before the chunk reaches
        keeps = carry[..., -1:].to(q.dtype).unbind(2)
    total = log_f[..., -1]  # (B, H, nc): a chunk's whole decay (its last document's, from its start)
    # each chunk's own contribution to the state at its end, stabilised by its largest log weight g
    log_to_end = total[..., None] - log_f + ic  # b_L - b_j + i_j
    if starts is not None:
        log_to_end = torch.where(runs == runs[..., -1:], log_to_end, -torch.inf)
    # max().values, not amax(): amax's backward divides by the number of ties, which inductor recomputes in
    # backward and can find 0 of (NaN gate gradients from bf16 gates under autocast); max's goes to one index
    g = log_to_end.max(-1).values
    to_end = torch.exp(log_to_end - g[..., None])[..., None] * kc  # (B, H, nc, L, dk)
    chunk_C, chunk_n = to_end.transpose(-1, -2) @ vc, to_end.sum(-2)

    # the scan over chunks: states before each chunk (C, n, m), as the recurrence would have them. The inputs
    # are unbound once: indexing chunk c inside the loop would give each step a backward the size of the
    # whole sequence (O(n^2) in all)
    C, n, m = zero_state(q, v) if state is None else state
    states = []
    steps = zip(total.unsqueeze(-1).unbind(2), g.unsqueeze(-1).unbind(2), chunk_C.unbind(2), chunk_n.unbind(2),
                keeps)
    for chunk_total, chunk_max, contribution_C, contribution_n, keep in steps:
        states.append((C, n, m))
        if keep is not None:  # 0 where a document starts in the chunk: the state before it is dropped, m = 0
            m = m * keep
        m_new = torch.maximum(chunk_total + m, chunk_max)
        decay, gain = torch.exp(chunk_total + m - m_new), torch.exp(chunk_max - m_new)
        if keep is not None:
            decay = decay * keep
        C = decay[..., None] * C + gain[..., None] * contribution_C
        n = decay * n + gain * contribution_n
        m = m_new
    C_before = torch.stack([s[0] for s in states], dim=2)  # (B, H, nc, dk, dv)
    n_before = torch.stack([s[1] for s in states], dim=2)  # (B, H, nc, dk)
    m_before = torch.stack([s[2] for s in states], dim=2)  # (B, H, nc, 1)

    log_weights = torch.where(causal, log_f[..., :, None] - log_f[..., None, :] + ic[..., None, :], -torch.inf)
    log_initial = log_f + m_before  # (B, H, nc, L)
    if starts is not None:
        log_initial = log_f + torch.where(carry, m_before, 0)
    m_t = torch.maximum(log_weights.max(-1).values, log_initial)  # (max, not amax: see g above)
    weights = torch.exp(log_weights - m_t[..., None]) * (qc @ kc.transpose(-1, -2))
    initial = torch.exp(log_initial - m_t)[..., None]
    if starts is not None:
        initial = initial * carry[..., None]
    numerator = weights @ vc + initial * (qc @ C_before)
    qn = weights.sum(-1, keepdim=True) + initial * (qc @ n_before[..., None])
    denominator = torch.maximum(qn.abs(), torch.exp(-m_t)[..., None])
    h = (numerator / (denominator + eps)).reshape(B, H, nc * chunk, -1)[:, :, :length]
    if return_stats:
        stats = tuple(t.reshape(B, H, nc * chunk)[:, :, :length] for t in (denominator, m_t))
        return h, (C, n, m), stats
    return h, (C, n, m)

