"""The recurrence core (attention/ops/recurrence) under every kind of gates its mixers use: the chunked, one-step and
parallel forms agree forward and backward (float64, exact), from a state and with packed documents (each document
equals itself run alone, no gradient reaches an earlier one, a sequence of one document changes no bit); a
hand-worked delta rule; float32 within noise over long rows; no n x n tensor; and a stretch's summary (what
context parallelism passes on) composes in any grouping to the state one pass leaves."""

import math

import pytest
import torch
import torch.nn.functional as F

from attention import simulate_cuda
from attention.documents import begins_document
from attention.ops.linear.feature_map import TAYLOR
from attention.ops.recurrence import (IDENTITY, Gates, State, chunked_recurrence, parallel_recurrence,
                                      stepwise_recurrence)
from attention.ops.recurrence.memory import chunked_saved
from attention.ops.recurrence.summary import apply, combine, summarise
from conftest import generator
from helpers import LargestTensor, covering, packed_documents

ROWS, HEADS, DK, DV = 3, 2, 4, 5
# the kinds of gates the mixers give the core: linear attention (Taylor features, no gates), the mLSTM (decay and
# exponential gains, stabilised), Gated DeltaNet (decay and the delta rule), retention (a decay alone:
# examples/retention.py), and those the core serves as well
KINDS = ("taylor", "stabilised", "delta", "decay", "decay_gain", "gain", "delta_no_decay")


def inputs(kind, n, seed=0, dtype=torch.float64, state=False):
    """q, k, v, the gates and the feature map of one kind (3 rows, 2 heads, odd widths), and a state to start from
    (None without `state`); every tensor requires grad."""
    g = generator(seed)
    randn = lambda *shape: torch.randn(ROWS, HEADS, *shape, generator=g, dtype=dtype)  # noqa: E731
    q, k, v = randn(n, DK), randn(n, DK), randn(n, DV)
    features, leaves = IDENTITY, {}
    if kind == "taylor":
        features = TAYLOR
    elif kind == "stabilised":  # gates near the mLSTM's initialisation (input -10, forget 3..6)
        leaves = {"log_decay": F.logsigmoid(randn(n) * 2 + 4), "log_gain": randn(n) * 3 - 10}
    elif kind == "decay_gain":
        leaves = {"log_decay": -F.softplus(randn(n)), "log_gain": randn(n) * 0.5}
    elif kind == "decay":
        leaves = {"log_decay": -F.softplus(randn(n))}
    elif kind == "gain":
        leaves = {"log_gain": randn(n) * 0.5}
    else:  # the delta rule: unit keys, q scaled as Gated DeltaNet's
        q, k = F.normalize(q, dim=-1) / 2, F.normalize(k, dim=-1)
        leaves = {"beta": torch.sigmoid(randn(n))}
        if kind == "delta":
            leaves["log_decay"] = -F.softplus(randn(n))
    tensors = [t.detach().requires_grad_() for t in (q, k, v, *leaves.values())]
    gates = Gates(**dict(zip(leaves, tensors[3:])), stabilised=kind == "stabilised")
    start = None
    if state:
        width = features.dim(k)
        S = randn(width, DV) * (0.1 if kind == "taylor" else 1)
        if kind == "taylor":  # linear attention's normaliser column stays positive
            S[..., -1] = S[..., -1].abs() + 1
        start = State(S.requires_grad_(), randn(1).requires_grad_() if kind == "stabilised" else None)
    return tensors, gates, features, start


def run(form, tensors, gates, features, state=None, starts=None, chunk=8):
    """(reads, m or None, final state) of one form."""
    q, k, v = tensors[:3]
    if form == "chunked":
        return chunked_recurrence(q, k, v, gates, state, chunk, starts, features)
    return {"step": stepwise_recurrence, "parallel": parallel_recurrence}[form](q, k, v, gates, state, starts, features)


def outputs(result):
    reads, m, final = result
    return [t for t in (reads, m, final.S, final.m) if t is not None]


def state_leaves(state):
    return [] if state is None else [t for t in state if t is not None]


def probe_grads(values, leaves):
    g = generator(1)
    weights = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in values]
    return torch.autograd.grad(values, leaves, weights, allow_unused=True)


def document_starts_of(n, continues=False, eot_last=False, seed=0):
    """starts (3, n) of packed documents of 1 to 12 tokens (row 0 with one at its first token and one of length 1,
    the last row with none). continues: only row 0 drops the state it starts from."""
    docs = packed_documents(ROWS, n, lengths=(1, 12), seed=seed, eot_last=eot_last)
    starts = begins_document(docs, torch.arange(n))
    if continues:
        starts[1:, 0] = False
    return starts


def assert_all_close(a, b, **tolerance):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x is None or y is None:  # a leaf that no output reads (every row restarts at once)
            assert x is None or not x.any(), "a dropped state got a gradient"
            continue
        torch.testing.assert_close(x, y, **tolerance)


# every kind at every length and chunk; the state to start from is a path of its own, taken at some of them
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, chunk, with_state", [(n, chunk, with_state) for (n, chunk), with_state in covering(
    [(37, 8), (32, 16), (5, 8), (1, 4), (9, 1)], [False, True])])
def test_forms_agree_forward_and_backward(kind, n, chunk, with_state):
    tensors, gates, features, state = inputs(kind, n, state=with_state)
    leaves = tensors + state_leaves(state)
    results = {form: run(form, tensors, gates, features, state, chunk=chunk) for form in ("parallel", "chunked", "step")}
    reference = outputs(results.pop("parallel"))
    reference_grads = probe_grads(reference, leaves)
    for form, result in results.items():
        assert_all_close(outputs(result), reference)  # float64: torch's default tolerances
        assert_all_close(probe_grads(outputs(result), leaves), reference_grads)


def by_document(tensors, gates, features, state, starts):
    """The definition of documents: each row cut at its documents' starts, every piece run alone from a zero
    state (its first piece from `state` when the row continues it) by the one-step form; the reads concatenated
    and each row's last state."""
    reads, scales, finals = [], [], []
    for b in range(starts.shape[0]):
        cuts = sorted({0, starts.shape[1], *starts[b].nonzero().flatten().tolist()})
        row_state = None if state is None or starts[b, 0] else State(*(t if t is None else t[b:b + 1] for t in state))
        pieces = []
        for begin, end in zip(cuts[:-1], cuts[1:]):
            piece = lambda t: None if t is None else t[b:b + 1, :, begin:end]  # noqa: E731
            row_gates = Gates(piece(gates.log_decay), piece(gates.log_gain), piece(gates.beta), gates.stabilised)
            pieces.append(stepwise_recurrence(*(piece(t) for t in tensors[:3]), row_gates,
                                              row_state if begin == 0 else None, None, features))
        reads.append(torch.cat([p[0] for p in pieces], dim=2))
        scales.append(None if pieces[0][1] is None else torch.cat([p[1] for p in pieces], dim=2))
        finals.append(pieces[-1][2])
    m = None if scales[0] is None else torch.cat(scales)
    final = State(torch.cat([f.S for f in finals]), None if m is None else torch.cat([f.m for f in finals]))
    return torch.cat(reads), m, final


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, chunk, continues", [(n, chunk, continues) for (n, chunk), continues in covering(
    [(37, 8), (29, 16), (6, 4), (1, 4)], [False, True])])
def test_each_document_equals_itself_alone_forward_and_backward(kind, n, chunk, continues):
    # odd lengths, documents of length 1, an end-of-text token at the first position (row 0), a row with none;
    # continues: the other rows carry the state they start from. Every form against one reference (the documents
    # run one by one, stepwise), its gradients taken once
    tensors, gates, features, state = inputs(kind, n, state=continues)
    starts = document_starts_of(n, continues=continues)
    reference = outputs(by_document(tensors, gates, features, state, starts))
    leaves = tensors + state_leaves(state)
    reference_grads = probe_grads(reference, leaves)
    for form in ("parallel", "chunked", "step"):
        result = outputs(run(form, tensors, gates, features, state, starts, chunk))
        assert_all_close(result, reference)
        grads = probe_grads(result, leaves)
        assert all(g is None or torch.isfinite(g).all() for g in grads), form
        assert_all_close(grads, reference_grads)


@pytest.mark.parametrize("kind", KINDS)
def test_no_gradient_reaches_an_earlier_document(kind):
    # exactly zero, not rounding's residue of cancelling terms: row 0's reads from its document starting at 19
    # (inside a chunk) on send nothing to its tokens before, in every form
    tensors, gates, features, _ = inputs(kind, 37, seed=5)
    starts = document_starts_of(37)
    starts[0, 19] = True
    for form in ("parallel", "chunked", "step"):
        reads = run(form, tensors, gates, features, starts=starts)[0]
        for grad in torch.autograd.grad(reads[0, :, 19:].square().sum(), tensors):
            assert not grad[0, :, :19].any() and grad[0, :, 19:].any(), form


@pytest.mark.parametrize("kind", KINDS)
def test_end_of_text_at_the_last_position_and_documents_in_every_chunk(kind):
    tensors, gates, features, _ = inputs(kind, 64, seed=2)
    starts = document_starts_of(64, eot_last=True, seed=2)
    assert starts[0, -1]
    reference = outputs(by_document(tensors, gates, features, None, starts))
    for chunk in (16, 1, 64):
        assert_all_close(outputs(run("chunked", tensors, gates, features, None, starts, chunk)), reference)


@pytest.mark.parametrize("simulate", [False, True], ids=["cpu", "simulated_cuda"])
@pytest.mark.parametrize("kind", KINDS)
def test_documents_without_a_boundary_change_no_bit(kind, simulate):
    # a sequence that is one document: its first token begins it (nothing before it to drop), or, continuing a
    # state, no token does; alone, and as the last row beside rows with boundaries; in every form. simulate: the
    # CPU standing in for CUDA, where nothing may ask the data on the host
    tensors, gates, features, state = inputs(kind, 37, state=True)
    one = torch.zeros(ROWS, 37, dtype=torch.bool)
    one[:, 0] = True
    cases = [(None, one, slice(None)), (state, torch.zeros_like(one), slice(None)),
             (None, document_starts_of(37), -1), (state, document_starts_of(37, continues=True), -1)]
    with torch.no_grad(), simulate_cuda.simulating(simulate):
        for form in ("parallel", "chunked", "step"):
            for state_in, starts, rows in cases:
                with_docs, without = (outputs(run(form, tensors, gates, features, state_in, s)) for s in (starts, None))
                for a, b in zip(with_docs, without):
                    assert torch.equal(a[rows], b[rows]), form


@pytest.mark.parametrize("form", ["chunk1", "chunk2", "chunk4", "step", "parallel"])
def test_the_delta_rule_on_two_tokens_by_hand(form):
    # S_t = a_t (I - b_t k_t^T k_t) S_{t-1} + b_t k_t^T v_t, y_t = q_t S_t, from S_0 = 0:
    #   t=1: S_1 = 0.5 [1, 0]^T 2 = [[1], [0]];  y_1 = [1, 0] S_1 = 1
    #   t=2: a S_1 = [[0.8], [0]]; k_2 (a S_1) = 0.48; delta = 0.25 (1 - 0.48) = 0.13
    #        S_2 = [[0.8 + 0.6 * 0.13], [0.8 * 0.13]] = [[0.878], [0.104]];  y_2 = [0, 1] S_2 = 0.104
    t = lambda *x: torch.tensor(x, dtype=torch.float64).view(1, 1, 2, -1)  # noqa: E731
    q, k, v = t(1.0, 0.0, 0.0, 1.0), t(1.0, 0.0, 0.6, 0.8), t(2.0, 1.0)
    gates = Gates(log_decay=torch.tensor([math.log(0.5), math.log(0.8)], dtype=torch.float64).view(1, 1, 2),
                  beta=torch.tensor([0.5, 0.25], dtype=torch.float64).view(1, 1, 2))
    chunk = int(form[-1]) if form.startswith("chunk") else 8
    y, _, final = run("chunked" if form.startswith("chunk") else form, [q, k, v], gates, IDENTITY, chunk=chunk)
    torch.testing.assert_close(y.flatten(), torch.tensor([1.0, 0.104], dtype=torch.float64))
    torch.testing.assert_close(final.S.flatten(), torch.tensor([0.878, 0.104], dtype=torch.float64))


@pytest.mark.parametrize("kind", KINDS)
def test_float32_stays_within_noise_of_float64_over_a_long_row_of_short_documents(kind):
    # the states restart and decay over 4096 tokens: float32 within float32 noise of float64
    tensors, gates, features, _ = inputs(kind, 4096, seed=8)
    tensors = [t.detach()[:1, :1] for t in tensors]
    names = [name for name in ("log_decay", "log_gain", "beta") if getattr(gates, name) is not None]
    gates64 = Gates(**dict(zip(names, tensors[3:])), stabilised=gates.stabilised)
    gates32 = Gates(**dict(zip(names, (t.float() for t in tensors[3:]))), stabilised=gates.stabilised)
    starts = document_starts_of(4096, seed=8)[:1]
    exact = chunked_recurrence(*tensors[:3], gates64, None, 64, starts, features)[0]
    single = chunked_recurrence(*(t.float() for t in tensors[:3]), gates32, None, 64, starts, features)[0]
    torch.testing.assert_close(single.double(), exact, rtol=1e-4, atol=1e-4 * exact.abs().max().item())


def test_strong_decay_does_not_overflow():
    # log decays summing to -3000 in a chunk: exp(G_i - G_j) above the diagonal would be inf
    tensors, gates, features, _ = inputs("delta", 16)
    gates = Gates(log_decay=torch.full_like(gates.beta, -200.0), beta=gates.beta)
    y, _, final = run("chunked", tensors, gates, features, chunk=16)
    assert torch.isfinite(y).all() and torch.isfinite(final.S).all()
    torch.testing.assert_close(y, run("step", tensors, gates, features)[0])


@pytest.mark.parametrize("kind", KINDS)
def test_the_chunked_form_with_documents_never_builds_an_n_by_n_tensor(kind):
    n, chunk = 1024, 64  # 16 chunks: an n x n tensor would be 16 times the bound
    tensors, gates, features, _ = inputs(kind, n, dtype=torch.float32)
    tensors = [t.detach()[:1, :1].requires_grad_() for t in tensors]
    names = [name for name in ("log_decay", "log_gain", "beta") if getattr(gates, name) is not None]
    gates = Gates(**dict(zip(names, tensors[3:])), stabilised=gates.stabilised)
    with LargestTensor() as largest:
        reads = chunked_recurrence(*tensors[:3], gates, None, chunk, document_starts_of(n)[:1], features)[0]
        reads.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in tensors)
    assert largest.numel <= n * max(chunk, features.dim(tensors[1])), largest.shape


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("with_documents", [False, True], ids=["one_stream", "documents"])
def test_summaries_compose_in_any_grouping_to_the_state_one_pass_leaves(kind, with_documents):
    # a sequence cut into stretches of 10, 1, 19 and 7 tokens (one shorter than a chunk, one of a token): their
    # maps combined left to right and in another grouping, applied to the state before, equal one pass's state
    tensors, gates, features, state = inputs(kind, 37, state=True)
    starts = document_starts_of(37) if with_documents else None
    final = run("chunked", tensors, gates, features, state, starts)[2]
    cuts = [0, 10, 11, 30, 37]
    maps = []
    for begin, end in zip(cuts[:-1], cuts[1:]):
        piece = lambda t: None if t is None else t[..., begin:end]  # noqa: E731
        stretch = Gates(piece(gates.log_decay), piece(gates.log_gain), piece(gates.beta), gates.stabilised)
        rows = None if starts is None else starts[:, begin:end]
        maps.append(summarise(tensors[1][:, :, begin:end], tensors[2][:, :, begin:end], stretch, rows, 8, features))
    left = maps[0]
    for later in maps[1:]:
        left = combine(left, later)
    grouped = combine(maps[0], combine(combine(maps[1], maps[2]), maps[3]))
    for whole in (left, grouped):
        assert_all_close(state_leaves(apply(whole, state)), state_leaves(final))


def saved_bytes(fn) -> int:
    """Bytes of every tensor autograd keeps for backward during fn(), each storage counted once."""
    seen = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, chunk, width, values", [(128, 64, 16, 16), (64, 32, 8, 24), (128, 64, 4, 9)])
def test_the_byte_model_is_what_the_chunked_form_keeps(kind, n, chunk, width, values):
    # the gates are made before the call, from leaves: only what the form itself keeps is measured
    g = generator(0)
    leaf = lambda *shape: torch.randn(ROWS, HEADS, *shape, generator=g).requires_grad_()  # noqa: E731
    q, k, v = leaf(n, width), leaf(n, width), leaf(n, values)
    gates = {"stabilised": dict(log_decay=-F.softplus(leaf(n)), log_gain=leaf(n), stabilised=True),
             "delta": dict(log_decay=-F.softplus(leaf(n)), beta=torch.sigmoid(leaf(n))),
             "delta_no_decay": dict(beta=torch.sigmoid(leaf(n))),
             "decay_gain": dict(log_decay=-F.softplus(leaf(n)), log_gain=leaf(n)),
             "decay": dict(log_decay=-F.softplus(leaf(n))), "gain": dict(log_gain=leaf(n))}.get(kind, {})
    features = TAYLOR if kind == "taylor" else IDENTITY
    measured = saved_bytes(lambda: chunked_recurrence(q, k, v, Gates(**gates), None, chunk, None, features))
    estimated = 4 * ROWS * HEADS * n * chunked_saved(
        chunk, width, values, decay="log_decay" in gates, gain="log_gain" in gates, delta="beta" in gates,
        stabilised=gates.get("stabilised", False), features=features)
    assert abs(estimated - measured) <= 0.03 * measured, (estimated, measured)
