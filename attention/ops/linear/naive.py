"""Taylor linear attention's reference, O(n^2): the kernel matrix 1 + t + t^2/2, causally masked, rows normalised."""

from __future__ import annotations

import torch

from attention.ops.linear.feature_map import taylor_kernel


def quadratic_linear_attention(q, k, v, starts=None):
    """The O(n^2) reference: causal kernel matrix, each row normalised. starts (B, n) bool: the tokens that begin
    a document, which no later token reaches across; None: none."""
    n = q.shape[-2]
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if starts is not None:
        runs = starts.cumsum(-1)[:, None]  # equal within one document
        mask = mask & (runs.unsqueeze(-1) == runs.unsqueeze(-2))
    weights = taylor_kernel(q, k) * mask
    return (weights @ v) / weights.sum(-1, keepdim=True)
