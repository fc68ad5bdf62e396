"""Taylor linear attention's reference, O(n^2): the kernel matrix 1 + t + t^2/2, causally masked, rows normalised."""

from __future__ import annotations

import torch

from attention.ops.linear.feature_map import taylor_kernel


def quadratic_linear_attention(q, k, v):
    """The O(n^2) reference: causal kernel matrix, each row normalised."""
    n = q.shape[-2]
    weights = taylor_kernel(q, k) * torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return (weights @ v) / weights.sum(-1, keepdim=True)
