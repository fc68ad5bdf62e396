"""Gated DeltaNet's reference: the gated delta rule token by token from the state, as it is stated
(attention/gated_deltanet.py); also the generation form (constant memory)."""

from __future__ import annotations

import torch


def recurrent_gated_delta_rule(q, k, v, g, beta, state=None, starts=None):
    """Token by token from the state: the reference, and the generation form. starts (B, n) bool: the tokens
    that begin a document, where the state restarts from zero; None: none."""
    B, H, n, d = q.shape
    S = q.new_zeros(B, H, d, v.shape[-1]) if state is None else state
    outputs = []
    for t in range(n):
        if starts is not None:
            S = torch.where(starts[:, t, None, None, None], 0, S)
        k_t = k[:, :, t]
        S = g[:, :, t, None, None].exp() * S
        delta = beta[:, :, t, None] * (v[:, :, t] - (k_t.unsqueeze(-2) @ S).squeeze(-2))
        S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outputs.append((q[:, :, t].unsqueeze(-2) @ S).squeeze(-2))
    return torch.stack(outputs, dim=2), S
