"""The chunked gated recurrence under every recurrent mixer (linear attention, the mLSTM, Gated DeltaNet).

Per head, with rows as vectors, keys k_t (d_k), values v_t (d_v) and queries q_t mapped by a feature map phi
(the identity, or linear attention's Taylor features), the state S (phi's width x d_v) follows

    S_t = a_t (I - beta_t phi(k_t)^T phi(k_t)) S_{t-1} + w_t phi(k_t)^T v_t,        y_t = phi(q_t) S_t

where the gates (gates.py: Gates) are all optional: a_t = exp(log_decay_t) <= 1 (none: 1), the delta rule's
strength beta_t (none: 0; with it the write weight w_t is beta_t, Gated DeltaNet's rule), else the write weight
w_t = exp(log_gain_t) (none: 1; the mLSTM's exponential input gate). A stabilised recurrence (the mLSTM's) keeps S
divided by exp(m_t), m_t = max(log a_t + m_{t-1}, log_gain_t), and returns m_t beside each read, so that the
exponential gates never overflow; a mixer that normalises its read (a sum of the keys' weights, carried as a
column of ones appended to v) divides by it itself. A document start restarts the state from zero (and m from 0).

Three forms, equal to float tolerance (tests/ops/test_recurrence.py), each taking an initial state and returning
the final one:
    naive.py    parallel_recurrence, the reference: the whole sequence at once, O(n^2) (the delta rule's
                triangular system solved over the whole sequence)
    chunk.py    chunked_recurrence, training and prompts, O(n): the parallel form inside chunks, the state
                between them
    step.py     stepwise_recurrence, generation: one token at a time from the state, constant memory
and what context parallelism composes (summary.py): the effect of a stretch of tokens on the state as one affine
map, which combine in any grouping, so the maps of several shards combine in parallel.
"""

import torch

from attention.ops.recurrence.chunk import chunked_recurrence
from attention.ops.recurrence.gates import IDENTITY, FeatureMap, Gates, State
from attention.ops.recurrence.naive import parallel_recurrence
from attention.ops.recurrence.step import stepwise_recurrence
from attention.ops.recurrence.summary import incoming_state

FORMS = ("chunked", "step", "parallel")


def recurrence(form: str, q, k, v, gates: Gates = Gates(), state: State | None = None, starts=None,
               features: FeatureMap = IDENTITY, chunk: int = 64, shard=None):
    """The recurrence in one of its FORMS (chunk: the chunked form's chunk length), in the inputs' own dtype:
    autocast is off inside, so that no matmul of the state runs in bf16. Returns (reads, m or None, state).
    shard (attention/ops/shard.py): q, k, v are one process's shard of a sequence under context parallelism, which
    starts from the state the earlier shards leave (summary.py: incoming_state) instead of zero."""
    with torch.autocast(q.device.type, enabled=False):
        if shard is not None:
            if state is not None or form == "step":
                raise ValueError("a shard of a sequence starts from the state its earlier shards leave: no state of "
                                 "its own, and not one token at a time")
            state = incoming_state(shard, k, v, gates, starts, chunk, features)
        if form == "chunked":
            return chunked_recurrence(q, k, v, gates, state, chunk, starts, features)
        if form == "step":
            return stepwise_recurrence(q, k, v, gates, state, starts, features)
        if form == "parallel":
            return parallel_recurrence(q, k, v, gates, state, starts, features)
    raise ValueError(f"unknown recurrence form {form!r}: expected one of {', '.join(FORMS)}")


__all__ = ["FORMS", "IDENTITY", "FeatureMap", "Gates", "State", "chunked_recurrence", "parallel_recurrence",
           "recurrence", "stepwise_recurrence"]
