"""Taylor linear attention's chunked form, O(n): exact within chunks, the running state (S, z) between them
(training and prompts)."""

from __future__ import annotations

import torch

from attention.ops.linear.feature_map import taylor_features, taylor_kernel


def chunked_linear_attention(q, k, v, state=None, chunk: int = 64):
    """O(n) causal Taylor linear attention of q, k (B, H, n, d) and v (B, H, n, D).

    state: (S, z) with S (B, H, F, D) and z (B, H, F) summarising earlier tokens, or None. Returns the output
    and the state after the last token.
    """
    B, H, n, d = q.shape
    D = v.shape[-1]
    pad = -n % chunk
    if pad:
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    nc = (n + pad) // chunk
    qc, kc, vc = (t.reshape(B, H, nc, chunk, -1) for t in (q, k, v))
    valid = (torch.arange(n + pad, device=q.device) < n).to(q.dtype).view(nc, chunk, 1)
    phi_k = taylor_features(kc) * valid  # padded keys contribute nothing to the state
    kv = phi_k.transpose(-1, -2) @ vc  # (B, H, nc, F, D): each chunk's contribution
    ksum = phi_k.sum(-2)  # (B, H, nc, F)
    S0 = torch.zeros(B, H, kv.shape[-2], D, dtype=q.dtype, device=q.device) if state is None else state[0]
    z0 = torch.zeros(B, H, ksum.shape[-1], dtype=q.dtype, device=q.device) if state is None else state[1]
    S_before = S0.unsqueeze(2) + kv.cumsum(2) - kv  # state at the start of each chunk
    z_before = z0.unsqueeze(2) + ksum.cumsum(2) - ksum
    phi_q = taylor_features(qc)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    within = taylor_kernel(qc, kc) * causal * valid.transpose(-1, -2)
    numerator = within @ vc + phi_q @ S_before
    denominator = within.sum(-1) + (phi_q @ z_before.unsqueeze(-1)).squeeze(-1)
    y = (numerator / denominator.unsqueeze(-1)).reshape(B, H, n + pad, D)[:, :, :n]
    return y, (S_before[:, :, -1] + kv[:, :, -1], z_before[:, :, -1] + ksum[:, :, -1])
