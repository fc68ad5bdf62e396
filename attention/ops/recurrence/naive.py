"""The recurrence's parallel reference, O(n^2): the whole sequence at once, as one matrix of log weights (the
delta rule's corrections from one triangular system over the whole sequence). Tests hold the chunked and one-step
forms to it."""

from __future__ import annotations

import torch

from attention.documents import document_cumsum
from attention.ops.recurrence.gates import IDENTITY, FeatureMap, Gates, State, zero_state


def parallel_recurrence(q, k, v, gates: Gates = Gates(), state: State | None = None, starts=None,
                        features: FeatureMap = IDENTITY):
    """The reads phi(q_t) S_t of the whole sequence at once: q, k (B, H, n, d_k), v (B, H, n, d_v), gates
    (B, H, n) each, state before the first token (None: zero), starts (B, n) bool where documents begin. Returns
    the reads, m_t of a stabilised recurrence (else None) and the state after the last token.

    With G_t the log decay summed from the token's document's start (or the sequence's) and c_t whether the
    state before the sequence reaches t (no document start at or before it):
        S_t = c_t exp(G_t) S_0 + sum_{j <= t, same document} exp(G_t - G_j) phi(k_j)^T u_j
    where u_j = w_j v_j, or for the delta rule u = (I + A)^-1 (beta v - beta c exp(G) phi(k) S_0) with
    A_ij = beta_i phi(k_i) . phi(k_j) exp(G_i - G_j) for j < i in one document."""
    n = q.shape[2]
    phi_q, phi_k = features.features(q), features.features(k)
    S0, m0 = zero_state(phi_k.shape[-1], v, gates.stabilised) if state is None else state
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    zeros = torch.zeros(q.shape[:3], dtype=q.dtype, device=q.device)
    log_decay = zeros if gates.log_decay is None else gates.log_decay
    if starts is None:
        G = log_decay.cumsum(-1)
        carry = torch.ones(1, 1, n, dtype=torch.bool, device=q.device)
    else:
        G = document_cumsum(log_decay, starts[:, None])
        runs = starts.cumsum(-1)[:, None]  # equal within one document
        causal = causal & (runs[..., :, None] == runs[..., None, :])
        carry = runs == 0
    log_w = zeros if gates.log_gain is None else gates.log_gain
    # log of the weight of key j in S_t, -inf off the causal same-document pairs
    log_weights = torch.where(causal, G[..., :, None] - G[..., None, :] + log_w[..., None, :], -torch.inf)
    log_initial = torch.where(carry, G, -torch.inf)  # of the state before the sequence in S_t
    if gates.stabilised:
        # the recurrence's m_t: the largest log weight, the zero state's (m = 0) from a document's start on
        m = torch.maximum(log_weights.amax(-1), G + torch.where(carry, m0, 0))
        log_initial = log_initial + m0
    else:
        m = torch.zeros_like(G)
    weights = torch.exp(log_weights - m[..., None])
    initial = torch.exp(log_initial - m)[..., None]
    values = v
    if gates.beta is not None:
        beta = gates.beta[..., None]
        A = (beta * phi_k) @ phi_k.transpose(-1, -2) * weights.tril(-1)
        rhs = beta * v - beta * initial * (phi_k @ S0)
        values = torch.linalg.solve_triangular(A + torch.eye(n, dtype=q.dtype, device=q.device), rhs, upper=False)
    reads = (features.kernel(q, k) * weights) @ values + initial * (phi_q @ S0)
    # the state after the last token: the last row's weights, over keys as columns
    last_w, last_initial = weights[..., -1, :, None], initial[..., -1, :, None]
    S_n = (phi_k * last_w).transpose(-1, -2) @ values + last_initial * S0
    return reads, (m if gates.stabilised else None), State(S_n, m[..., -1:] if gates.stabilised else None)
