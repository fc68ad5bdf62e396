"""Multi-head self-attention with its shared plumbing, and the `full` causal variant.

`Attention` owns what every attention variant shares: the q/k/v projection, RoPE at the tokens' original
positions, the optional sigmoid output gate and the output projection. A variant overrides `attend`, which
maps per-head q, k, v (B, H, T, D) to per-head outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attention.registry import Mixer, register
from attention.rope import apply_rope


@dataclass
class KVCache:
    """Keys and values of every position seen so far (preallocated to max_len)."""

    k: torch.Tensor  # (B, H, max_len, D)
    v: torch.Tensor
    length: int = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.length, self.length + k.shape[2]
        if end > self.k.shape[2]:
            raise RuntimeError(f"KV cache holds {self.k.shape[2]} positions; cannot append up to {end}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class Attention(Mixer):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # gate of paper 000 (Alg. 2): y <- sigmoid(W y) * y, W d x d without bias, before the output projection
        self.gate = nn.Linear(config.n_embd, config.n_embd, bias=False) if config.attn_gate else None
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.rope_theta = config.rope_theta if config.resolved_pos_embedding == "rope" else None
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, pos, cache=None):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        if self.rope_theta is not None:
            q, k = apply_rope(q, pos, self.rope_theta), apply_rope(k, pos, self.rope_theta)
        y = self.attend(q, k, v, pos, cache).transpose(1, 2).reshape(B, T, C)
        if self.gate is not None:
            y = torch.sigmoid(self.gate(y)) * y
        return self.resid_dropout(self.c_proj(y))

    def attend(self, q, k, v, pos, cache):
        raise NotImplementedError

    def init_cache(self, batch_size, max_len, device, dtype):
        shape = (batch_size, self.n_head, max_len, self.head_dim)
        return KVCache(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))


@register("full")
class CausalSelfAttention(Attention):
    """Causal attention over all previous positions (PyTorch SDPA: flash / memory-efficient kernels)."""

    def attend(self, q, k, v, pos, cache):
        dropout_p = self.dropout if self.training else 0.0
        if cache is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        past = cache.length
        k, v = cache.append(k, v)
        T = q.shape[2]
        if T == 1:  # one new token sees every cached key
            return F.scaled_dot_product_attention(q, k, v)
        key_pos = torch.arange(past + T, device=q.device)
        mask = key_pos[None, :] <= (past + torch.arange(T, device=q.device))[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def mixing_flops(self, seq_len):
        # QK^T and AV: 2 matmuls x 2 FLOPs per multiply-add, over (seq_len + 1) / 2 causal keys on average
        return 4 * self.n_head * self.head_dim * (seq_len + 1) / 2
