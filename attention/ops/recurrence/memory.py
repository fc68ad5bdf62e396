"""What the recurrence's chunked form keeps for backward, per position and head: the byte model a mixer built on
the core adds its own projections and reads to (its ActivationMemory, attention/capabilities.py), held to the
tensors autograd saves in tests/ops/test_recurrence.py."""

from __future__ import annotations

from attention.ops.recurrence.gates import IDENTITY, FeatureMap


def chunked_saved(chunk: int, q_width: int, v_width: int, *, decay: bool = False, gain: bool = False,
                  delta: bool = False, stabilised: bool = False, features: FeatureMap = IDENTITY,
                  learned: bool = True) -> float:
    """Elements (in the inputs' dtype) the chunked form keeps per position and head, without documents, for q and
    k of q_width (f), v of v_width (D), chunks of L = `chunk` tokens and the feature map's width F, under the gates
    it is given (learned: they require gradients; constant gates keep less). q, k and v are counted, as the form
    keeps them; its reads (the output) are the caller's.

        plain        the within-chunk kernel applied to v (L), q and k (2 f), v (D), the state before each chunk
                     (F D / L); a map with a kernel of its own (Taylor) adds q . k (L), phi(q) and phi(k) (2 F);
                     learned gates add q k^T before its weights (L); a decay its weights (L), the decayed q and k
                     (2 F) and, learned, the scan's states (F D / L); a gain the weighted decay (L) and, alone, the
                     weighted k (F)
        stabilised   q k^T, the weights' exponential and the weights (3 L), q, k and the keys decayed to the
                     chunk's end (3 F), v and q times the state before the chunk (2 D), the state before each
                     chunk, each chunk's own contribution and the scan's states (3 F D / L), ~5 scalars
        delta rule   the decay, A before and after its mask, q k^T and its masked form (5 L), the WY solution
                     u|w (D + F), v and the corrections (2 D), k, beta k, q and the decayed q and k (5 F), the
                     state per chunk (F D / L), ~5 scalars; without a decay the masks are constants: A and the
                     masked q k^T (2 L), q, k, beta k (3 F)"""
    L, f, D = chunk, q_width, v_width
    F = features.width(f)
    if stabilised:
        return 3 * L + 3 * F + 2 * D + 3 * F * D / L + 5
    if delta:
        if decay:
            return 5 * L + 3 * D + 6 * F + F * D / L + 5
        return 2 * L + 3 * D + 4 * F + F * D / L + 3
    saved = L + 2 * f + D + F * D / L
    if features is not IDENTITY:
        saved += L + 2 * F
    if (decay or gain) and learned:
        saved += L
    if decay:
        saved += L + 2 * F + (F * D / L + 3 if learned else 2)
    if gain:
        saved += L + (1 if decay else F + 2)
    return saved
