"""The recurrence's one-step form: one token at a time from the state, constant memory (generation, and the
recurrence exactly as stated, which the other forms are held to)."""

from __future__ import annotations

import torch

from attention.ops.recurrence.gates import IDENTITY, FeatureMap, Gates, State, zero_state


def stepwise_recurrence(q, k, v, gates: Gates = Gates(), state: State | None = None, starts=None,
                        features: FeatureMap = IDENTITY):
    """Token by token: q, k (B, H, n, d_k), v (B, H, n, d_v), gates (B, H, n) each. starts (B, n) bool: the tokens
    that begin a document, where the state restarts from zero (and m from 0); None: none. Returns the reads
    phi(q_t) S_t (B, H, n, d_v), the stabiliser m_t (B, H, n) of a stabilised recurrence (else None) and the state
    after the last token."""
    phi_q, phi_k = features.features(q), features.features(k)
    S, m = zero_state(phi_k.shape[-1], v, gates.stabilised) if state is None else state
    reads, scales = [], []
    for t in range(q.shape[2]):
        if starts is not None:
            keep = ~starts[:, t, None, None]  # (B, 1, 1)
            S = torch.where(keep[..., None], S, 0)
            m = None if m is None else torch.where(keep, m, 0)
        log_a = None if gates.log_decay is None else gates.log_decay[:, :, t, None]  # (B, H, 1)
        log_w = None if gates.log_gain is None else gates.log_gain[:, :, t, None]
        k_t, v_t = phi_k[:, :, t], v[:, :, t]
        if gates.stabilised:
            carried = m if log_a is None else log_a + m
            m_new = carried if log_w is None else torch.maximum(carried, log_w)
            decay, weight = torch.exp(carried - m_new), torch.exp((0 if log_w is None else log_w) - m_new)
            m = m_new
            scales.append(m)
        else:
            decay = None if log_a is None else log_a.exp()
            weight = None if log_w is None else log_w.exp()
        if decay is not None:
            S = decay[..., None] * S
        if gates.beta is not None:  # the delta rule: correct the read for k_t towards v_t, by beta_t
            beta = gates.beta[:, :, t, None]
            delta = beta * (v_t - (k_t.unsqueeze(-2) @ S).squeeze(-2))
            S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        else:
            write = k_t.unsqueeze(-1) * v_t.unsqueeze(-2)
            S = S + (write if weight is None else weight[..., None] * write)
        reads.append((phi_q[:, :, t].unsqueeze(-2) @ S).squeeze(-2))
    m_out = torch.cat(scales, dim=-1) if gates.stabilised and scales else None
    return torch.stack(reads, dim=2), m_out, State(S, m)
