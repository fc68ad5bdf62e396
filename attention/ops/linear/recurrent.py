"""Taylor linear attention's recurrent form: one token at a time from the state (S, z), constant memory
(generation)."""

from __future__ import annotations

import torch

from attention.ops.linear.feature_map import taylor_features


def recurrent_linear_attention(q, k, v, state=None, starts=None):
    """Token by token from the state: the generation form (and a third reference in tests). starts (B, n) bool:
    the tokens that begin a document, where the state restarts from zero; None: none."""
    B, H, n, d = q.shape
    F_dim = 1 + d + d * d
    S = torch.zeros(B, H, F_dim, v.shape[-1], dtype=q.dtype, device=q.device) if state is None else state[0]
    z = torch.zeros(B, H, F_dim, dtype=q.dtype, device=q.device) if state is None else state[1]
    outputs = []
    for t in range(n):
        if starts is not None:
            S, z = torch.where(starts[:, t, None, None, None], 0, S), torch.where(starts[:, t, None, None], 0, z)
        phi_k, phi_q = taylor_features(k[:, :, t]), taylor_features(q[:, :, t])
        S = S + phi_k.unsqueeze(-1) * v[:, :, t].unsqueeze(-2)
        z = z + phi_k
        outputs.append((phi_q.unsqueeze(-2) @ S).squeeze(-2) / (phi_q * z).sum(-1, keepdim=True))
    return torch.stack(outputs, dim=2), (S, z)
