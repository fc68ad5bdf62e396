"""The short causal depthwise convolution on Gated DeltaNet's q, k and v, continuing from a state of the last inputs
(training, prompts and generation alike)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attention import simulate_cuda


def causal_conv(x, weight, state=None, reach=None):
    """Depthwise causal convolution of x (B, T, C) with weight (C, 1, K), continuing from state: the K-1 inputs
    before x (B, C, K-1), zeros at the start of a sequence. reach (B, T): how many of the inputs just before
    each token are in its document (its position minus its document's first), which alone its output reads;
    None: all. Returns the output (B, T, C) and the new state."""
    width, length = weight.shape[-1], x.shape[1]
    x = x.transpose(1, 2)
    earlier = torch.arange(length, device=x.device)  # the real inputs before each token
    if state is None:
        state = x.new_zeros(x.shape[0], x.shape[1], width - 1)  # zeros before a sequence: no mask needed
    else:
        earlier = earlier + width - 1
    padded = torch.cat([state.to(x.dtype), x], dim=-1)
    y = F.conv1d(padded, weight, groups=x.shape[1])
    tail = padded[..., padded.shape[-1] - (width - 1):]
    if reach is None:
        return y.transpose(1, 2), tail
    # the taps each output may read: fewer than K - 1 earlier ones only where its window holds an earlier
    # document's inputs; everywhere else the convolution's own bits stay
    taps = torch.where(reach < earlier, reach, width - 1)
    lag = torch.arange(width - 1, -1, -1, device=x.device)  # how far back each tap of weight reads
    if simulate_cuda.gpu_path(x.device):
        # without a host synchronisation: every truncated convolution, of which each output takes its own
        for back in range(width - 1):
            near = F.conv1d(padded, weight * (lag <= back), groups=x.shape[1])
            y = torch.where(taps[:, None] == back, near, y)
        return y.transpose(1, 2), tail
    # on the CPU the few outputs just after a document's start are found on the host and summed alone
    rows, cols = (taps < width - 1).nonzero(as_tuple=True)
    windows = padded[rows[:, None], :, cols[:, None] + torch.arange(width, device=x.device)]  # (n, K, C)
    kept = (lag <= taps[rows, cols, None])[..., None] * weight[:, 0].t()  # (n, K, C)
    return y.transpose(1, 2).index_put((rows, cols), (windows * kept).sum(1)), tail
