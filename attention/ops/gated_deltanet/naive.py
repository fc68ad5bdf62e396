"""Gated DeltaNet's reference: the gated delta rule token by token from the state, as it is stated
(attention/gated_deltanet.py); also the generation form (constant memory)."""

from __future__ import annotations

import torch


def recurrent_gated_delta_rule(q, k, v, g, beta, state=None):
    """Token by token from the state: the reference, and the generation form."""
    B, H, n, d = q.shape
    S = q.new_zeros(B, H, d, v.shape[-1]) if state is None else state
    outputs = []
    for t in range(n):
        k_t = k[:, :, t]
        S = g[:, :, t, None, None].exp() * S
        delta = beta[:, :, t, None] * (v[:, :, t] - (k_t.unsqueeze(-2) @ S).squeeze(-2))
        S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outputs.append((q[:, :, t].unsqueeze(-2) @ S).squeeze(-2))
    return torch.stack(outputs, dim=2), S
