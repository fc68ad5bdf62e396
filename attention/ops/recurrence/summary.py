"""A stretch of tokens' effect on the recurrence's state, as one affine map: what context parallelism passes
between the shards of a sequence.

The recurrence is linear in its state, so a stretch maps the state S before it to
    S_after = M S + C
with M the product of its transitions (for the delta rule a matrix per head, phi's width square; else the scalar
exp(total log decay)) and C what the stretch writes from a zero state. A document start inside the stretch makes
M zero: no state crosses it. Maps compose in any grouping (combine is associative), so the maps of P shards
combine in parallel, after one exchange of maps, rather than in a chain of P hops. A stabilised recurrence keeps
C divided by exp(g) and composes in log space: M is exp(A), A the total log decay (-inf across a document start).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from attention.ops.recurrence.chunk import chunked_recurrence
from attention.ops.recurrence.gates import IDENTITY, FeatureMap, Gates, State, zero_state


class Summary(NamedTuple):
    """S -> M S + C of a stretch, per head: M (B, H, F, F) for the delta rule, else log_M (B, H, 1), the log of
    the scalar; C (B, H, F, D), and for a stabilised recurrence g (B, H, 1), C's log scale."""

    M: torch.Tensor | None
    log_M: torch.Tensor | None
    C: torch.Tensor
    g: torch.Tensor | None = None


def summarise(k, v, gates: Gates, starts=None, chunk: int = 64, features: FeatureMap = IDENTITY) -> Summary:
    """The map of a stretch with keys k (B, H, n, d_k), values v, gates and document starts, from the chunked
    form (its reads are not needed: q is zero)."""
    q = torch.zeros_like(k)
    cut = None if starts is None else starts.any(-1)[:, None, None]  # (B, 1, 1): a document starts inside
    if gates.beta is None:
        empty = None
        if gates.stabilised:  # no state at all (m = -inf), so that g is the largest of the stretch's own weights
            F_dim, (B, H) = features.dim(k), k.shape[:2]
            empty = State(v.new_zeros(B, H, F_dim, v.shape[-1]), v.new_full((B, H, 1), -torch.inf))
        _, _, final = chunked_recurrence(q, k, v, gates, empty, chunk, starts, features)
        total = torch.zeros(k.shape[:2] + (1,), dtype=k.dtype, device=k.device) if gates.log_decay is None \
            else gates.log_decay.sum(-1, keepdim=True)
        log_M = total if cut is None else torch.where(cut, -torch.inf, total)
        return Summary(None, log_M, final.S, final.m)
    # the delta rule: M is the map's effect on an identity state, run beside the values with zero values
    F_dim, D = features.dim(k), v.shape[-1]
    eye = torch.eye(F_dim, dtype=v.dtype, device=v.device).expand(*k.shape[:2], F_dim, F_dim)
    state = State(torch.cat([torch.zeros(*k.shape[:2], F_dim, D, dtype=v.dtype, device=v.device), eye], -1))
    wide = torch.cat([v, torch.zeros(*v.shape[:3], F_dim, dtype=v.dtype, device=v.device)], -1)
    _, _, final = chunked_recurrence(q, k, wide, gates, state, chunk, starts, features)
    return Summary(final.S[..., D:], None, final.S[..., :D])


def combine(first: Summary, then: Summary) -> Summary:
    """The map of `first` followed by `then`."""
    if first.M is not None:
        return Summary(then.M @ first.M, None, then.M @ first.C + then.C)
    log_M = first.log_M + then.log_M
    if first.g is None:
        return Summary(None, log_M, torch.exp(then.log_M)[..., None] * first.C + then.C)
    g = torch.maximum(then.log_M + first.g, then.g)
    scale_first, scale_then = torch.exp(then.log_M + first.g - g), torch.exp(then.g - g)
    return Summary(None, log_M, scale_first[..., None] * first.C + scale_then[..., None] * then.C, g)


def apply(summary: Summary, state: State) -> State:
    """The state after the stretch, from the state before it."""
    if summary.M is not None:
        return State(summary.M @ state.S + summary.C)
    if summary.g is None:
        return State(torch.exp(summary.log_M)[..., None] * state.S + summary.C)
    m = torch.maximum(summary.log_M + state.m, summary.g)
    S = torch.exp(summary.log_M + state.m - m)[..., None] * state.S + torch.exp(summary.g - m)[..., None] * summary.C
    return State(S, m)


def incoming_state(shard, k, v, gates: Gates, starts=None, chunk: int = 64,
                   features: FeatureMap = IDENTITY) -> State:
    """The state flowing into this process's shard of a sequence (attention/ops/shard.py): every process
    summarises its own shard, the summaries are all-gathered (one exchange, whatever the number of processes),
    and the maps of the shards before this one are combined and applied to the zero state. The gradient of the
    state reaches the earlier shards' keys, values and gates through the exchange's backward, in which every
    process takes part: the first shard's zero state depends on the exchange too, with weight zero."""
    mine = summarise(k, v, gates, starts, chunk, features)
    present = [name for name in Summary._fields if getattr(mine, name) is not None]
    parts = [getattr(mine, name) for name in present]
    flat = shard.all_gather(torch.cat([t.reshape(-1) for t in parts]), "recurrent state")
    zero = zero_state(features.dim(k), v, gates.stabilised)
    if shard.rank == 0:
        return State(zero.S + (0 * flat).nan_to_num(0.0).sum(), zero.m)  # a -inf log decay times 0 is not 0
    maps = []
    for r in range(shard.rank):
        fields, offset = dict.fromkeys(Summary._fields), 0
        for name, t in zip(present, parts):
            fields[name] = flat[r, offset:offset + t.numel()].view(t.shape)
            offset += t.numel()
        maps.append(Summary(**fields))
    total = maps[0]
    for later in maps[1:]:
        total = combine(total, later)
    return apply(total, zero)
