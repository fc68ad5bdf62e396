"""Generation caches of attention layers: every key so far, or a rolling window of the most recent ones."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVCache:
    """Keys and values of every position seen so far: full causal attention. Allocated for the length asked
    (max_len), and grown (doubled) when a sequence runs past it, so a generation's length need not be known up
    front."""

    def __init__(self, shape, device, dtype):
        batch_size, n_head, max_len, head_dim = shape
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    @property
    def empty(self) -> bool:
        return self.length == 0

    def update(self, k, v, pos):
        """Store the new keys/values (B, H, T, D) at positions pos; return all keys, values and positions."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.k.shape[2]:
            capacity = max(end, 2 * self.k.shape[2])
            for name in ("k", "v"):
                old = getattr(self, name)
                grown = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
                grown[:, :, :start] = old[:, :, :start]
                setattr(self, name, grown)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end], torch.arange(end, device=k.device)


class RollingKVCache:
    """The last `size` keys and values (a ring buffer indexed by position % size): constant memory per token.

    Enough for any rule whose lookback is below size; slots not yet written carry position -1.
    """

    def __init__(self, shape, device, dtype):
        batch_size, n_head, size, head_dim = shape
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = torch.full((size,), -1, device=device, dtype=torch.long)

    @property
    def empty(self) -> bool:
        return bool((self.pos < 0).all())

    def update(self, k, v, pos):
        """Return the cached keys followed by the new ones (with positions), then keep the newest `size`."""
        keys, values, key_pos = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2), torch.cat([self.pos, pos])
        size = self.k.shape[2]
        keep = slice(max(0, k.shape[2] - size), k.shape[2])
        slots = pos[keep] % size
        self.k[:, :, slots] = k[:, :, keep]
        self.v[:, :, slots] = v[:, :, keep]
        self.pos[slots] = pos[keep]
        return keys, values, key_pos


@dataclass
class RecurrentState:
    """Generation state of a recurrent mixer (linear attention's (S, z), the mLSTM's (C, n, m)): the summary
    of every token seen so far, of constant size, or None before the first token."""

    state: tuple | None = None

    @property
    def empty(self) -> bool:
        return self.state is None


def state_bytes(state) -> int:
    """Bytes of every tensor held by a generation state (a layer's cache object, or a list of them)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(s) for s in state)
    if hasattr(state, "__dict__"):
        return sum(state_bytes(s) for s in vars(state).values())
    return 0
