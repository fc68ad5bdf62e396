"""What a mixer receives with its input for one forward, as one typed object."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class MixerCall:
    """Everything a mixer's forward(x, call) receives besides x (B, T, C).

    pos    (T,) absolute positions of x's tokens: RoPE, ALiBi and position-dependent masks use them.
    cache  the object the mixer's init_cache returned, updated in place, during generation; None in training.
    plan   what the mixer's plan(B, T, device) returned for this forward (None: the mixer plans for itself).
    docs   (B, T) where each token's document begins (attention/documents.py), given when the model masks
           documents (config.document_mask) and only to mixers that declare takes_documents: no edge and no
           state may cross from one document into the next. None: the sequence is one stream.
    shard  under context parallelism (attention/ops/shard.py), which shard of the sequence x is: pos are its
           positions in the whole sequence, and what its rule reaches on other shards is exchanged with the
           processes that hold them. Given only to mixers that declare context_parallel. None: x is the whole
           sequence.
    """

    pos: torch.Tensor
    cache: Any = None
    plan: Any = None
    docs: torch.Tensor | None = None
    shard: Any = None

    @staticmethod
    def at(seq_len: int, device, plan=None, docs=None) -> "MixerCall":
        """A training-style call over positions 0..seq_len-1 (no cache): what the benchmarks and tests pass."""
        return MixerCall(torch.arange(seq_len, device=device), None, plan, docs)
