"""Span attention as two custom ops (forward, backward) with autograd: the Triton kernels on CUDA (opaque to
torch.compile: a compiled block holds each as one node). On CPU tensors the same kernels run under Triton's
interpreter (TRITON_INTERPRET=1, as the kernel tests run them); where the CPU stands in for CUDA
(attention/simulate_cuda.py) the naive reference runs instead, with the kernels' output contract (the interpreter
would take minutes per simulated training run)."""

from __future__ import annotations

import functools
import math
import os

import torch

from attention import simulate_cuda
from attention.edges import FixedBlock, SlidingWindow
from attention.ops.span.naive import span_attention_naive
from attention.ops.span.spans import KEY_GROUP, document_rows, static_spans

TILES_ENV = "EFFICIENT_ATTENTION_SPAN_TILES"  # "BLOCK_M,BLOCK_N,WARPS,STAGES": another tiling, for benchmarks


def _tiles() -> tuple[int, int, int, int]:
    """Query rows and keys per tile on the GPU (multiples of KEY_GROUP), warps and pipeline stages per program.
    64x64, 4 warps, 3 stages measured fastest on an H100 (docs/benchmarks.md: 128-row tiles 1.2-1.5x slower, 2
    stages 3-5% slower)."""
    text = os.environ.get(TILES_ENV, "").strip()
    if not text:
        return 64, 64, 4, 3
    try:
        tiles = tuple(int(x) for x in text.split(","))
    except ValueError:
        tiles = ()
    if len(tiles) != 4 or tiles[0] % 16 or tiles[1] % 16 or min(tiles) < 1:
        raise ValueError(f"{TILES_ENV}={text!r}: expected BLOCK_M,BLOCK_N,WARPS,STAGES with the blocks multiples of 16")
    return tiles


BLOCK_M, BLOCK_N, WARPS, STAGES = _tiles()
TEST_BLOCKS = (16, 16)  # the interpreter's tiles: several per sequence at the tests' lengths


def interpreting() -> bool:
    """Whether Triton kernels run under the interpreter (on CPU tensors): TRITON_INTERPRET=1 before triton loads."""
    return os.environ.get("TRITON_INTERPRET", "").strip() in ("1", "true", "True")


def triton_on_cpu() -> bool:
    """Whether the ops' CPU kernels run the Triton kernels (under the interpreter): when it is on, except while
    the CPU stands in for CUDA, where the naive reference keeps simulated training fast, unless the simulation asks
    for the kernels themselves (simulate_cuda.interpreted_kernels)."""
    return (interpreting() and triton_installed()
            and (not simulate_cuda.active() or simulate_cuda.interpreted_kernels()))


@functools.cache
def triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def span_blocks(device) -> tuple[int, int]:
    """(query rows, keys) per tile of the kernels on device."""
    return TEST_BLOCKS if torch.device(device).type == "cpu" else (BLOCK_M, BLOCK_N)


def layout_like_q(q):
    """An output (B, H, n, D) laid out (B, n, H, D) in memory: merging heads afterwards is a view."""
    B, H, n, D = q.shape
    return q.new_empty(B, n, H, D).transpose(1, 2)


def _common(q, k, spans_lo, order, slopes, docs):
    B, H, n, D = q.shape
    heads, rows = spans_lo.shape[-2:]
    return dict(H=H, GROUP=H // k.shape[1], N=rows, D=D, span_b=heads * rows if spans_lo.dim() == 3 else 0,
                span_h=0 if heads == 1 else rows, HAS_ORDER=order is not None, HAS_DOCS=docs is not None,
                HAS_BIAS=slopes is not None, IEEE=q.dtype == torch.float32,
                # the hardware's tanh for sigmoid: compiled CUDA code at half precision (not the interpreter's)
                FAST_SIGMOID=q.device.type == "cuda" and q.dtype != torch.float32,
                WIDEN=q.dtype == torch.bfloat16 and q.device.type == "cpu",
                BLOCK_D=max(16, 1 << (D - 1).bit_length()))


def _query_rows(q, halo: int) -> dict:
    """The query rows the forward and dq kernels walk: every row, or with halo >= 0 (in slots) the main rows of a
    layout's N_MEM + 2 halo rows, whose tokens are q's rows."""
    n = q.shape[2]
    return dict(N_MEM=n, ROW0=max(halo, 0), ROW_END=max(halo, 0) + n, IN_SLOTS=halo >= 0)


@functools.cache
def triton_kernels():
    """The Triton kernels' module, imported on first use: Triton may be absent (span_available), and its
    interpreter reads TRITON_INTERPRET as the kernels are defined."""
    from attention.ops.span import triton_kernels as kernels

    return kernels


def main_tokens(order, halo: int, n: int):
    """In slots (halo >= 0): the tokens of the n main rows, slot order (the layout's rows halo..); else None."""
    return None if halo < 0 else order[halo:halo + n]


def slot_documents(docs, order, halo: int, n: int):
    """The kernels read a row's document start per query row: in slots (halo >= 0) docs (B, n), given per token,
    gathered to slot order (one small gather), so that no kernel gathers them per row tile; else docs as given."""
    return docs if docs is None or halo < 0 else docs.index_select(1, main_tokens(order, halo, n)).contiguous()


def triton_forward(q, k, v, lo, hi, order, slopes, offset: float, sigmoid: bool, docs=None, halo: int = -1,
                   prev=None):
    """(output, log-sum-exps (B, H, n)). lo, hi (S, n), or (B, S, n) clipped to a batch's documents; docs (B, n)
    int32 or None; halo >= 0: the rows are a layout's in slots (see span_attention), and the log-sum-exps are per
    main row, in slot order; prev: another path's output (laid out as this one's), which the output includes (a
    sum of separately normalised paths, span_pair_attention)."""
    span_forward_kernel = triton_kernels().span_forward_kernel

    B, H, n, D = q.shape
    out = layout_like_q(q)
    lse = torch.empty(B, H, n, device=q.device, dtype=torch.float32)
    if sigmoid:
        lse.zero_()
    block_m, block_n = span_blocks(q.device)
    docs = slot_documents(docs, order, halo, n)
    dummy = lo  # never read when the option is off
    if prev is not None:
        assert prev.stride() == out.stride()
    span_forward_kernel[(triton_cdiv(n, block_m), B * H)](
        q, k, v, out, lse, lo, hi, dummy if order is None else order, dummy if slopes is None else slopes,
        dummy if docs is None else docs, out if prev is None else prev, *q.stride()[:3], *k.stride()[:3],
        *v.stride()[:3], *out.stride()[:3], qk_scale=1.4426950408889634 / math.sqrt(D), offset=offset,
        SIGMOID=sigmoid, ACCUMULATE=prev is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=WARPS, num_stages=STAGES,
        **_common(q, k, lo, order, slopes, docs), **_query_rows(q, halo))
    return out, lse


def triton_delta(grad, out, out_sum=None, tokens=None):
    """rowsum(dO * O) (B, H, n) in float32: FlashAttention's backward preprocessing. With out_sum (out one path's
    output of a sum of two, laid out alike): (out's delta, the other path's: rowsum(dO * (out_sum - out))).
    tokens (n,) int32: rows in slots, row r the token tokens[r]'s (the kernels' log-sum-exps in slots are per
    slot)."""
    span_delta_kernel = triton_kernels().span_delta_kernel

    B, H, n, D = out.shape
    grad = unit_stride(grad)
    delta = torch.empty(B, H, n, device=out.device, dtype=torch.float32)
    rest = delta if out_sum is None else torch.empty_like(delta)
    if out_sum is not None:
        assert out_sum.stride() == out.stride()
    block_m = span_blocks(out.device)[0]
    span_delta_kernel[(triton_cdiv(n, block_m), B * H)](out, grad, delta, out if out_sum is None else out_sum, rest,
                                                          delta if tokens is None else tokens, *out.stride()[:3],
                                                          *grad.stride()[:3], H, n, D, PAIR=out_sum is not None,
                                                          IN_SLOTS=tokens is not None, BLOCK_M=block_m,
                                                          BLOCK_D=max(16, 1 << (D - 1).bit_length()))
    return delta if out_sum is None else (delta, rest)


def triton_backward(grad, q, k, v, out, lse, lo, hi, key_first, key_end, order, slopes, offset: float,
                    sigmoid: bool, delta=None, docs=None, doc_end=None, halo: int = -1, into=None):
    """dq, dk, dv; into: another path's (dq, dk, dv), which these are added to, in the kernels, and returned."""
    kernels = triton_kernels()

    B, H, n, D = q.shape
    H_kv = k.shape[1]
    grad = unit_stride(grad)
    block_m, block_n = span_blocks(q.device)
    docs = slot_documents(docs, order, halo, n)
    common = _common(q, k, lo, order, slopes, docs)
    dummy = lo
    if delta is None:  # sigmoid reads neither
        delta = lse if sigmoid else triton_delta(grad, out, tokens=main_tokens(order, halo, n))
    dq, dk, dv = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)) if into is None else into
    # into's gradients are read and written at their own strides (empty_like lays a view of a fused projection out
    # densely, unlike q, k, v themselves)
    assert into is None or halo < 0
    order_, slopes_ = dummy if order is None else order, dummy if slopes is None else slopes
    docs_, doc_end_ = dummy if docs is None else docs, dummy if doc_end is None else doc_end
    scales = dict(sm_scale=1 / math.sqrt(D), qk_scale=1.4426950408889634 / math.sqrt(D), offset=offset)
    rows = _query_rows(q, halo)
    if halo >= 0:  # in slots: sa's band (softmax, no bias), dk and dv summed over each token's copies
        # half-height row tiles: its rows are gathered at their tokens, and the addresses of the tiles in flight
        # leave a 64-row tile no registers (spills, or no prefetching: docs/benchmarks.md, "gathered rows prefetched")
        kernels.span_backward_kv_slots_kernel[(triton_cdiv(n, block_n), B * H_kv)](
            q, k, v, grad, lse, delta, dk, dv, order, docs_,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *grad.stride()[:3], *dk.stride()[:3],
            *dv.stride()[:3], H=H, H_KV=H_kv, GROUP=common["GROUP"], N=common["N"],
            N_MEM=n, HALO=halo, D=D, sm_scale=scales["sm_scale"], qk_scale=scales["qk_scale"],
            HAS_DOCS=docs is not None, IEEE=common["IEEE"], WIDEN=common["WIDEN"], BLOCK_M=max(16, block_m // 2),
            BLOCK_N=block_n, BLOCK_D=common["BLOCK_D"], num_warps=WARPS, num_stages=STAGES)
    else:
        kernels.span_backward_kv_kernel[(triton_cdiv(n, block_n), B * H_kv)](
            q, k, v, grad, lse, delta, dk, dv, lo, hi, order_, slopes_, key_first, key_end, docs_, doc_end_,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *grad.stride()[:3], *dk.stride()[:3],
            *dv.stride()[:3], plan_h=0 if key_first.shape[0] == 1 else key_first.shape[1],
            plan_len=key_first.shape[1], H_KV=H_kv, SIGMOID=sigmoid, ACCUMULATE=into is not None, BLOCK_M=block_m,
            BLOCK_N=block_n, KEY_GROUP=KEY_GROUP, num_warps=WARPS, num_stages=STAGES, **scales, **common)
    kernels.span_backward_q_kernel[(triton_cdiv(n, block_m), B * H)](
        q, k, v, grad, lse, delta, dq, lo, hi, order_, slopes_, docs_,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *grad.stride()[:3], *dq.stride()[:3],
        SIGMOID=sigmoid, ACCUMULATE=into is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=WARPS,
        num_stages=STAGES, **scales, **common, **rows)
    return dq, dk, dv


def unit_stride(x):
    """x with a unit stride along its last dimension, which the kernels read rows with (an output's gradient may be
    an expanded scalar: stride 0)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- the custom ops --------------------------------------------------------------------------------------------

@torch.library.custom_op("efficient_attention::span_forward", mutates_args=(), device_types="cuda")
def span_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                 key_first: torch.Tensor, key_end: torch.Tensor, order: torch.Tensor | None,
                 slopes: torch.Tensor | None, docs: torch.Tensor | None, doc_end: torch.Tensor | None, offset: float,
                 sigmoid: bool, halo: int) -> tuple[torch.Tensor, torch.Tensor]:
    return triton_forward(q, k, v, lo, hi, order, slopes, offset, sigmoid, docs, halo)


@span_forward.register_fake
def _(q, k, v, lo, hi, key_first, key_end, order, slopes, docs, doc_end, offset, sigmoid, halo):
    B, H, n, _ = q.shape
    return layout_like_q(q), q.new_empty(B, H, n, dtype=torch.float32)


@torch.library.custom_op("efficient_attention::span_backward", mutates_args=(), device_types="cuda")
def span_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, key_first: torch.Tensor,
                  key_end: torch.Tensor, order: torch.Tensor | None, slopes: torch.Tensor | None,
                  docs: torch.Tensor | None, doc_end: torch.Tensor | None, offset: float,
                  sigmoid: bool, halo: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return triton_backward(grad, q, k, v, out, lse, lo, hi, key_first, key_end, order, slopes, offset, sigmoid,
                           docs=docs, doc_end=doc_end, halo=halo)


@span_backward.register_fake
def _(grad, q, k, v, out, lse, lo, hi, key_first, key_end, order, slopes, docs, doc_end, offset, sigmoid, halo):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# On the CPU (the CPU standing in for CUDA): the Triton kernels themselves under the interpreter, else the naive
# reference, returning what the kernels return: the output laid out (B, n, H, D), gradients like their inputs
def naive_in_slots(q, k, v, lo, hi, order, slopes, offset, sigmoid, docs, halo: int):
    """The reference where the rows are a layout's in slots (halo >= 0): q, k, v and docs gathered to the rows
    (row r holds token order[r]), attended there, and each token's output taken from its main row (halo..); the
    log-sum-exps per main row, in slot order."""
    if halo < 0:
        return span_attention_naive(q, k, v, lo, hi, order, slopes, offset, sigmoid, docs)
    rows, n = order.long(), q.shape[2]
    q, k, v = (t.index_select(2, rows) for t in (q, k, v))
    y, lse = span_attention_naive(q, k, v, lo, hi, order, slopes, offset, sigmoid,
                                  None if docs is None else docs.index_select(1, rows))
    main = torch.empty(n, dtype=torch.long, device=rows.device)
    main[rows[halo:halo + n]] = torch.arange(halo, halo + n, device=rows.device)  # each token's main row
    # the log-sum-exps per main row, their own tensor as the kernels' (a view into the slots' would carry an
    # offset that the op's fake kernel, and so a compiled graph, does not)
    return y.index_select(2, main), lse[:, :, halo:halo + n].contiguous()


@span_forward.register_kernel("cpu")
def _cpu_forward(q, k, v, lo, hi, key_first, key_end, order, slopes, docs, doc_end, offset, sigmoid, halo):
    simulate_cuda.ran("span")
    if triton_on_cpu():
        return triton_forward(q, k, v, lo, hi, order, slopes, offset, sigmoid, docs, halo)
    y, lse = naive_in_slots(q, k, v, lo, hi, order, slopes, offset, sigmoid, docs, halo)
    out = layout_like_q(q)
    out.copy_(y)
    return out, lse


@span_backward.register_kernel("cpu")
def _cpu_backward(grad, q, k, v, out, lse, lo, hi, key_first, key_end, order, slopes, docs, doc_end, offset,
                  sigmoid, halo):
    simulate_cuda.ran("span")
    if triton_on_cpu():
        return triton_backward(grad, q, k, v, out, lse, lo, hi, key_first, key_end, order, slopes, offset, sigmoid,
                               docs=docs, doc_end=doc_end, halo=halo)
    with simulate_cuda.autograd_in_kernel():
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        y, _ = naive_in_slots(*inputs, lo, hi, order, slopes, offset, sigmoid, docs, halo)
        dq, dk, dv = torch.autograd.grad(y, inputs, grad)
    return (torch.empty_like(q).copy_(dq), torch.empty_like(k).copy_(dk), torch.empty_like(v).copy_(dv))


def _setup_context(ctx, inputs, output):
    q, k, v, lo, hi, key_first, key_end, order, slopes, docs, doc_end, offset, sigmoid, halo = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, lo, hi, key_first, key_end, order, slopes, docs, doc_end)
    ctx.offset, ctx.sigmoid, ctx.halo = offset, sigmoid, halo


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, lo, hi, key_first, key_end, order, slopes, docs, doc_end = ctx.saved_tensors
    dq, dk, dv = span_backward(grad_out, q, k, v, out, lse, lo, hi, key_first, key_end, order, slopes, docs, doc_end,
                               ctx.offset, ctx.sigmoid, ctx.halo)
    return dq, dk, dv, *([None] * 11)


span_forward.register_autograd(_backward, setup_context=_setup_context)


def document_spans(spans, docs, start: int = 0, rows=None) -> tuple:
    """(lo, hi, docs, doc_end) as the kernels take them for docs (B, n) or None. A document is a run of rows in
    token order: each row's span is cut to it (spans (B, 1 or H, n)), so the kernels skip the key blocks (and the
    backward the query rows) outside it at no cost per block; rows in another order (sa's slots) keep their spans
    and the kernels test each key against its row's document start. rows: document_rows(docs, start), when the caller
    has them already."""
    if docs is None:
        return spans.lo, spans.hi, None, None
    if spans.order is not None:  # token indices, as the order's: the kernels compare the two
        return spans.lo, spans.hi, (docs - start).to(torch.int32).contiguous(), None
    first, end = document_rows(docs, start) if rows is None else rows
    return (torch.maximum(spans.lo, first[:, None]).contiguous(), torch.minimum(spans.hi, end[:, None]).contiguous(),
            first, end)


def span_attention(q, k, v, spans, slopes=None, offset: float = 0.0, sigmoid: bool = False, docs=None,
                   start: int = 0, halo: int = -1):
    """Attention of q (B, H, n, D) over k, v (B, H_kv, n, D) along the spans (attention/ops/span/spans.py: Spans),
    softmax or sigmoid, with the optional bias slopes[h] (i - j) + offset. docs (B, n): where each row's document
    begins (attention/documents.py), rows at positions start.. (in the spans' order, when they have one), or None.
    The output is (B, H, n, D), laid out (B, n, H, D) in memory.

    halo >= 0, in slots: the spans are over a layout's n + 2 halo rows (attention/layouts.py: row r holds token
    spans.order[r], the main rows halo.. each token once, the rest copies of the slots at either end: stochastic
    attention's band); q, k, v, docs and the output stay in token order, and the kernels read and write each row
    at its token, so nothing is gathered or scattered around them."""
    if q.shape[-1] != k.shape[-1] or q.shape[-1] != v.shape[-1]:
        raise ValueError("span attention needs q, k and v of one head dimension")
    if halo >= 0 and (spans.order is None or slopes is not None or sigmoid
                      or spans.lo.shape[-1] != q.shape[2] + 2 * halo):
        raise ValueError("span attention in slots takes softmax over a layout's band: n + 2 halo rows in an order")
    q, k, v = (unit_stride(t) for t in (q, k, v))
    lo, hi, docs, doc_end = document_spans(spans, docs, start)
    out, _ = span_forward(q, k, v, lo, hi, spans.key_first, spans.key_end, spans.order, slopes, docs, doc_end,
                          float(offset), bool(sigmoid), int(halo))
    return out


# ---- two paths over one q, k, v: each normalised on its own, summed (the bridges' branch fusion) or apart (sa_swa) --

def triton_pair_forward(q, k, v, lo_a, hi_a, lo_b, hi_b, docs_a, docs_b, order_a=None, halo_a: int = -1,
                        summed: bool = True):
    """(out, path a's output, each path's log-sum-exp): out is path b's output, plus a's where summed (b's forward
    adding a's output in as it stores its own). Path a may run in slots (halo_a >= 0, its rows in order_a: see
    span_attention), b in token order; docs_a, docs_b: the documents each path's kernels read."""
    out_a, lse_a = triton_forward(q, k, v, lo_a, hi_a, order_a, None, 0.0, False, docs_a, halo_a)
    out, lse_b = triton_forward(q, k, v, lo_b, hi_b, None, None, 0.0, False, docs_b, prev=out_a if summed else None)
    return out, out_a, lse_a, lse_b


def triton_pair_backward(grad, grad_a, q, k, v, out, out_a, lse_a, lse_b, lo_a, hi_a, first_a, end_a, order_a,
                         docs_a, lo_b, hi_b, first_b, end_b, docs_b, doc_end, halo_a: int = -1, summed: bool = True):
    """dq, dk, dv of both paths, b's kernels adding their gradients into a's as they store them (no additions
    after). summed: grad is out's, both deltas from one read of dO (b's from out - out_a); else grad is b's output's
    and grad_a a's."""
    if summed:
        delta_a, delta_b = triton_delta(grad, out_a, out)
        grad_a = grad
    else:
        delta_a = triton_delta(grad_a, out_a, tokens=main_tokens(order_a, halo_a, q.shape[2]))
        delta_b = triton_delta(grad, out)
    into = triton_backward(grad_a, q, k, v, out_a, lse_a, lo_a, hi_a, first_a, end_a, order_a, None, 0.0, False,
                           delta=delta_a, docs=docs_a, doc_end=doc_end if halo_a < 0 else None, halo=halo_a)
    return triton_backward(grad, q, k, v, out, lse_b, lo_b, hi_b, first_b, end_b, None, None, 0.0, False,
                           delta=delta_b, docs=docs_b, doc_end=doc_end, into=into)


@torch.library.custom_op("efficient_attention::span_pair_forward", mutates_args=(), device_types="cuda")
def span_pair_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo_a: torch.Tensor, hi_a: torch.Tensor,
                      key_first_a: torch.Tensor, key_end_a: torch.Tensor, order_a: torch.Tensor | None,
                      docs_a: torch.Tensor | None, lo_b: torch.Tensor, hi_b: torch.Tensor, key_first_b: torch.Tensor,
                      key_end_b: torch.Tensor, docs: torch.Tensor | None, doc_end: torch.Tensor | None, halo_a: int,
                      summed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return triton_pair_forward(q, k, v, lo_a, hi_a, lo_b, hi_b, docs_a, docs, order_a, halo_a, summed)


@span_pair_forward.register_fake
def _(q, k, v, lo_a, hi_a, key_first_a, key_end_a, order_a, docs_a, lo_b, hi_b, key_first_b, key_end_b, docs,
      doc_end, halo_a, summed):
    B, H, n, _ = q.shape
    return (layout_like_q(q), layout_like_q(q), q.new_empty(B, H, n, dtype=torch.float32),
            q.new_empty(B, H, n, dtype=torch.float32))


@torch.library.custom_op("efficient_attention::span_pair_backward", mutates_args=(), device_types="cuda")
def span_pair_backward(grad: torch.Tensor, grad_a: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, out: torch.Tensor, out_a: torch.Tensor, lse_a: torch.Tensor,
                       lse_b: torch.Tensor, lo_a: torch.Tensor, hi_a: torch.Tensor, key_first_a: torch.Tensor,
                       key_end_a: torch.Tensor, order_a: torch.Tensor | None, docs_a: torch.Tensor | None,
                       lo_b: torch.Tensor, hi_b: torch.Tensor, key_first_b: torch.Tensor, key_end_b: torch.Tensor,
                       docs: torch.Tensor | None, doc_end: torch.Tensor | None, halo_a: int,
                       summed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return triton_pair_backward(grad, grad_a, q, k, v, out, out_a, lse_a, lse_b, lo_a, hi_a, key_first_a, key_end_a,
                                order_a, docs_a, lo_b, hi_b, key_first_b, key_end_b, docs, doc_end, halo_a, summed)


@span_pair_backward.register_fake
def _(grad, grad_a, q, k, v, out, out_a, lse_a, lse_b, lo_a, hi_a, key_first_a, key_end_a, order_a, docs_a, lo_b,
      hi_b, key_first_b, key_end_b, docs, doc_end, halo_a, summed):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _naive_pair(q, k, v, lo_a, hi_a, order_a, docs_a, lo_b, hi_b, docs, halo_a):
    y_a, lse_a = naive_in_slots(q, k, v, lo_a, hi_a, order_a, None, 0.0, False, docs_a, halo_a)
    y_b, lse_b = span_attention_naive(q, k, v, lo_b, hi_b, None, None, 0.0, False, docs)
    return y_a, y_b, lse_a, lse_b


@span_pair_forward.register_kernel("cpu")
def _cpu_pair_forward(q, k, v, lo_a, hi_a, key_first_a, key_end_a, order_a, docs_a, lo_b, hi_b, key_first_b,
                      key_end_b, docs, doc_end, halo_a, summed):
    simulate_cuda.ran("span")
    if triton_on_cpu():
        return triton_pair_forward(q, k, v, lo_a, hi_a, lo_b, hi_b, docs_a, docs, order_a, halo_a, summed)
    y_a, y_b, lse_a, lse_b = _naive_pair(q, k, v, lo_a, hi_a, order_a, docs_a, lo_b, hi_b, docs, halo_a)
    out, out_a = layout_like_q(q), layout_like_q(q)
    out_a.copy_(y_a)
    out.copy_(out_a + y_b if summed else y_b)
    return out, out_a, lse_a, lse_b


@span_pair_backward.register_kernel("cpu")
def _cpu_pair_backward(grad, grad_a, q, k, v, out, out_a, lse_a, lse_b, lo_a, hi_a, key_first_a, key_end_a, order_a,
                       docs_a, lo_b, hi_b, key_first_b, key_end_b, docs, doc_end, halo_a, summed):
    simulate_cuda.ran("span")
    if triton_on_cpu():
        return triton_pair_backward(grad, grad_a, q, k, v, out, out_a, lse_a, lse_b, lo_a, hi_a, key_first_a,
                                    key_end_a, order_a, docs_a, lo_b, hi_b, key_first_b, key_end_b, docs, doc_end,
                                    halo_a, summed)
    with simulate_cuda.autograd_in_kernel():
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        y_a, y_b, _, _ = _naive_pair(*inputs, lo_a, hi_a, order_a, docs_a, lo_b, hi_b, docs, halo_a)
        dq, dk, dv = torch.autograd.grad((y_a, y_b), inputs, (grad, grad) if summed else (grad_a, grad))
    return (torch.empty_like(q).copy_(dq), torch.empty_like(k).copy_(dk), torch.empty_like(v).copy_(dv))


def _pair_setup_context(ctx, inputs, output):
    (q, k, v, lo_a, hi_a, key_first_a, key_end_a, order_a, docs_a, lo_b, hi_b, key_first_b, key_end_b, docs, doc_end,
     halo_a, summed) = inputs
    out, out_a, lse_a, lse_b = output
    ctx.save_for_backward(q, k, v, out, out_a, lse_a, lse_b, lo_a, hi_a, key_first_a, key_end_a, order_a, docs_a,
                          lo_b, hi_b, key_first_b, key_end_b, docs, doc_end)
    ctx.halo_a, ctx.summed = halo_a, summed


def _pair_backward(ctx, grad_out, grad_out_a, grad_lse_a, grad_lse_b):
    # summed, out_a is what the backward reads, not an output of the op's caller (span_pair_attention returns out)
    if not ctx.summed:  # apart, a path whose output was not used may get None (the two outputs are alike)
        grad_out = torch.zeros_like(grad_out_a) if grad_out is None else grad_out
        grad_out_a = torch.zeros_like(grad_out) if grad_out_a is None else grad_out_a
    dq, dk, dv = span_pair_backward(grad_out, None if ctx.summed else unit_stride(grad_out_a), *ctx.saved_tensors,
                                    ctx.halo_a, ctx.summed)
    return dq, dk, dv, *([None] * 14)


span_pair_forward.register_autograd(_pair_backward, setup_context=_pair_setup_context)


def span_pair_attention(q, k, v, spans_a, spans_b, docs=None, start: int = 0):
    """span_attention(q, k, v, spans_a) + span_attention(q, k, v, spans_b), softmax, in token order, with no
    addition after either pass: the second path's kernels add the first's output and gradients in as they store
    theirs (the branch fusion of a layer whose paths() are two span rules: Kernel.run_sum)."""
    if spans_a.order is not None or spans_b.order is not None:
        raise ValueError("span attention of two paths summed takes rows in token order")
    return _pair(q, k, v, spans_a, spans_b, docs, start, -1, True)[0]


def span_pair_apart(q, k, v, spans_a, spans_b, docs=None, halo_a: int = -1):
    """(span_attention(q, k, v, spans_a, halo=halo_a), span_attention(q, k, v, spans_b)), softmax, in one call whose
    backward adds b's gradients into a's in the kernels (no additions of dq, dk, dv after): two paths over shared
    q, k, v with outputs of their own (sa_swa's sa in slots and its swa: Kernel.run_apart). Path a may run in slots
    (halo_a >= 0), b in token order."""
    if spans_b.order is not None or (halo_a < 0) != (spans_a.order is None):
        raise ValueError("span attention of two paths apart takes path a in token order or in slots (halo_a >= 0),"
                         " path b in token order")
    if halo_a >= 0 and spans_a.lo.shape[-1] != q.shape[2] + 2 * halo_a:
        raise ValueError("span attention in slots takes a layout's band: n + 2 halo rows in an order")
    out_b, out_a = _pair(q, k, v, spans_a, spans_b, docs, 0, halo_a, False)
    return out_a, out_b


def _pair(q, k, v, spans_a, spans_b, docs, start: int, halo_a: int, summed: bool):
    q, k, v = (unit_stride(t) for t in (q, k, v))
    rows = None if docs is None else document_rows(docs, start)
    lo_a, hi_a, docs_a, _ = document_spans(spans_a, docs, start, rows)
    lo_b, hi_b, docs_b, doc_end = document_spans(spans_b, docs, start, rows)
    out, out_a, _, _ = span_pair_forward(q, k, v, lo_a, hi_a, spans_a.key_first, spans_a.key_end, spans_a.order,
                                         docs_a, lo_b, hi_b, spans_b.key_first, spans_b.key_end, docs_b, doc_end,
                                         int(halo_a), bool(summed))
    return out, out_a


def _samples():
    """Arguments laid out as the layers pass them (heads-first views of (B, n, H, D) projections)."""
    generator = torch.Generator().manual_seed(0)
    B, H, n, D = 1, 2, 40, 16
    spans = static_spans(SlidingWindow(9), n, H, 0, "cpu")
    samples = []
    for dtype, sigmoid, slopes in ((torch.float32, False, None), (torch.bfloat16, True, torch.tensor([-0.5, 0.25]))):
        q, k, v = (torch.randn(B, n, H, D, generator=generator).to(dtype).transpose(1, 2) for _ in range(3))
        samples.append((q, k, v, spans.lo, spans.hi, spans.key_first, spans.key_end, None, slopes, None, None, 0.5,
                        sigmoid, -1))
    docs, doc_end = document_rows(torch.tensor([0] * 15 + [15] * 25).expand(B, n), 0)  # two documents
    lo, hi = torch.maximum(spans.lo, docs[:, None]), torch.minimum(spans.hi, doc_end[:, None])
    samples.append((*samples[0][:3], lo, hi, *samples[0][5:9], docs, doc_end, *samples[0][11:]))
    # in slots: a band of half-width 4 over a permutation extended by 4 rows at either end, with the two documents
    halo, order = 4, torch.randperm(n, generator=generator)
    rows = torch.arange(n + 2 * halo)
    token = order[(rows - halo) % n].to(torch.int32)
    lo = (rows - halo).clamp(min=0).to(torch.int32)[None]
    hi = (rows + halo + 1).clamp(max=n + 2 * halo).to(torch.int32)[None]
    samples.append((*samples[0][:3], lo, hi, *samples[0][5:7], token, None, docs, None, 0.0, False, halo))
    return samples


def _pair_samples():
    """Two rules' spans (a window and fixed blocks) over the same q, k, v, summed, without and with two documents;
    and apart, the first path a band in slots (_samples' last) with the documents."""
    generator = torch.Generator().manual_seed(1)
    B, H, n, D = 1, 2, 40, 16
    a, b = static_spans(SlidingWindow(9), n, H, 0, "cpu"), static_spans(FixedBlock(8), n, H, 0, "cpu")
    docs = torch.tensor([0] * 15 + [15] * 25).expand(B, n)
    samples = []
    for dtype, documents in ((torch.float32, None), (torch.bfloat16, docs)):
        q, k, v = (torch.randn(B, n, H, D, generator=generator).to(dtype).transpose(1, 2) for _ in range(3))
        rows = None if documents is None else document_rows(documents, 0)
        lo_a, hi_a, first, end = document_spans(a, documents, 0, rows)
        lo_b, hi_b, _, _ = document_spans(b, documents, 0, rows)
        samples.append((q, k, v, lo_a, hi_a, a.key_first, a.key_end, None, first, lo_b, hi_b, b.key_first,
                        b.key_end, first, end, -1, True))
    q, k, v, lo, hi, key_first, key_end, order, _, docs_a, _, _, _, halo = _samples()[-1]
    lo_b, hi_b, first, end = document_spans(a, docs, 0)
    samples.append((q, k, v, lo, hi, key_first, key_end, order, docs_a, lo_b, hi_b, a.key_first, a.key_end, first,
                    end, halo, False))
    return samples


@simulate_cuda.opcheck_samples("efficient_attention::span_pair_forward")
def _pair_forward_samples():
    return [tuple(t.requires_grad_() if i < 3 else t for i, t in enumerate(s)) for s in _pair_samples()]


@simulate_cuda.opcheck_samples("efficient_attention::span_pair_backward")
def _pair_backward_samples():
    samples = []
    for q, k, v, *rest in _pair_samples():
        out, out_a, lse_a, lse_b = _cpu_pair_forward(q, k, v, *rest)
        grad, grad_a = (torch.randn(out.shape[0], out.shape[2], out.shape[1], out.shape[3]).to(q.dtype)
                        .transpose(1, 2) for _ in range(2))
        summed = rest[-1]
        samples.append((grad, None if summed else grad_a, q, k, v, out, out_a, lse_a, lse_b, *rest))
    return samples


@simulate_cuda.opcheck_samples("efficient_attention::span_forward")
def _forward_samples():
    return [tuple(t.requires_grad_() if i < 3 else t for i, t in enumerate(s)) for s in _samples()]


@simulate_cuda.opcheck_samples("efficient_attention::span_backward")
def _backward_samples():
    samples = []
    for q, k, v, lo, hi, first, end, order, slopes, docs, doc_end, offset, sigmoid, halo in _samples():
        out, lse = _cpu_forward(q, k, v, lo, hi, first, end, order, slopes, docs, doc_end, offset, sigmoid, halo)
        grad = torch.randn(out.shape[0], out.shape[2], out.shape[1], out.shape[3]).to(q.dtype).transpose(1, 2)
        samples.append((grad, q, k, v, out, lse, lo, hi, first, end, order, slopes, docs, doc_end, offset, sigmoid,
                        halo))
    return samples
