"""The 2nd-order Taylor feature map of paper 002's linear attention (after Based), phi(x) = [1, x / d^(1/4),
vec(x x^T) / (sqrt(2) sqrt(d))], whose products phi(q) . phi(k) = 1 + t + t^2 / 2 (t = q . k / sqrt(d)) every form
computes: as features (the chunked and recurrent forms' states) or from q . k directly (taylor_kernel)."""

from __future__ import annotations

import torch

from attention.ops.recurrence.gates import FeatureMap


def taylor_features(x: torch.Tensor) -> torch.Tensor:
    """phi(x) for x (..., d): (..., 1 + d + d^2)."""
    d = x.shape[-1]
    second = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) / (2 ** 0.5 * d ** 0.5)
    return torch.cat([torch.ones_like(x[..., :1]), x / d ** 0.25, second], dim=-1)


def taylor_kernel(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """phi(q) . phi(k) for all pairs, computed from q . k directly: (..., Tq, Tk)."""
    t = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    return 1 + t + t * t / 2


# the recurrence core's feature map (attention/ops/recurrence): features for the state, the kernel inside chunks
TAYLOR = FeatureMap(features=taylor_features, kernel=taylor_kernel, width=lambda d: 1 + d + d * d)
