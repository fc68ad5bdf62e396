"""The short causal depthwise convolution on Gated DeltaNet's q, k and v, continuing from a state of the last inputs
(training, prompts and generation alike)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(x, weight, state=None):
    """Depthwise causal convolution of x (B, T, C) with weight (C, 1, K), continuing from state: the K-1 inputs
    before x (B, C, K-1), zeros at the start of a sequence. Returns the output (B, T, C) and the new state."""
    width = weight.shape[-1]
    x = x.transpose(1, 2)
    if state is None:
        state = x.new_zeros(x.shape[0], x.shape[1], width - 1)
    padded = torch.cat([state.to(x.dtype), x], dim=-1)
    y = F.conv1d(padded, weight, groups=x.shape[1])
    return y.transpose(1, 2), padded[..., padded.shape[-1] - (width - 1):]
