"""What the recurrence's forms take besides q, k and v: the gates, the state, and the feature map."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

# a log write weight that writes nothing (exp underflows to 0) and, finite, makes no inf - inf: padding and the
# mLSTM's padded positions
NO_INPUT = -1e30


@dataclass(frozen=True)
class Gates:
    """Per-token gates, each (B, H, n) or None.

    log_decay  log a_t <= 0, how much of the state carries over (None: all of it)
    log_gain   log w_t, the weight of the token's write (None: 1); not with beta
    beta       the delta rule's strength in (0, 1]: the state's read for phi(k_t) moves a fraction beta_t of the
               way to v_t (the write weight is beta_t)
    stabilised keep the state divided by exp(m_t) and return m_t (needed with exponential gains)
    """

    log_decay: torch.Tensor | None = None
    log_gain: torch.Tensor | None = None
    beta: torch.Tensor | None = None
    stabilised: bool = False

    def __post_init__(self):
        if self.beta is not None and self.log_gain is not None:
            raise ValueError("the delta rule writes with weight beta: give beta or log_gain, not both")
        if self.beta is not None and self.stabilised:
            raise ValueError("the delta rule's weights are at most 1: it needs no stabiliser")


class State(NamedTuple):
    """The recurrence's state: S (B, H, F, d_v) and, for a stabilised recurrence, its log scale m (B, H, 1)
    (S holds the state divided by exp(m)); m is None otherwise."""

    S: torch.Tensor
    m: torch.Tensor | None = None


def zero_state(q_features: int, v: torch.Tensor, stabilised: bool) -> State:
    """The state before the first token, zero (and m = 0), for values v (B, H, n, d_v)."""
    B, H, _, D = v.shape
    return State(v.new_zeros(B, H, q_features, D), v.new_zeros(B, H, 1) if stabilised else None)


@dataclass(frozen=True)
class FeatureMap:
    """phi applied to q and k before they meet the state, and phi(q) . phi(k) for all pairs of a chunk, which a
    map may compute without the features (the Taylor map's 1 + t + t^2 / 2 from q . k)."""

    features: Callable[[torch.Tensor], torch.Tensor]
    kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    width: Callable[[int], int]  # phi's output width for inputs of width d

    def dim(self, x: torch.Tensor) -> int:
        return self.width(x.shape[-1])


IDENTITY = FeatureMap(features=lambda x: x, kernel=lambda q, k: q @ k.transpose(-1, -2), width=lambda d: d)
