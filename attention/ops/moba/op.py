"""MoBA as custom ops with autograd: the block choice, and attention over the chosen blocks (forward, backward):
Triton on CUDA (opaque to torch.compile: no graph break, no host synchronisation), and on the CPU the same kernels
under Triton's interpreter, or the naive reference while the CPU stands in for CUDA (attention/ops/span/op.py:
triton_on_cpu).

Attention = a query's own block, causal (span attention over fixed blocks of c), plus its other chosen blocks
(the pair tiles of triton_kernels.py), merged as one softmax by the parts' log-sum-exps (one kernel). The backward runs span
attention's backward over the own blocks and the pair tiles' over the rest, both from the merged log-sum-exp and
rowsum(dO * O), as FlashAttention's backward does for any split of the keys.

With packed documents (docs (B, n): where each token's document begins) every part is cut at the query's document
start (naive.py): the own blocks by raising each row's span start to it, one batch row at a time (spans are per
head, not per batch row), the pairs inside their kernels, and the choice over the blocks' means within documents
(naive.py's document_means) among the blocks from the document's first."""

from __future__ import annotations

import functools
import math

import torch

from attention import simulate_cuda
from attention.documents import document_starts
from attention.edges import FixedBlock
from attention.ops.moba.naive import block_means, moba_choose, moba_naive
from attention.ops.span import op as span_op
from attention.ops.span.spans import static_spans

PAIR_ROWS, KEY_COLS = 64, 64  # pair tile rows, keys per step on the GPU
TEST_SIZES = (16, 16)
# the choice on the GPU: rows x mean keys per step x the TOPK - 1 places of each column's list (a score and a
# block each, in registers), at most CHOICE_TILE: 128 x 32 at top-2 (32 scores per thread, its shared-memory reads
# per product a third of 64 x 16's: the IEEE float32 tl.dot reads both operands from shared memory for every
# product), fewer rows and keys per step as the lists grow, without spills
CHOICE_TILE, CHOICE_ROWS, CHOICE_BLOCKS = 128 * 32, 128, 32


def _sizes(device):
    return TEST_SIZES if torch.device(device).type == "cpu" else (PAIR_ROWS, KEY_COLS)


def _choice_sizes(device, topk: int):
    """The choice's rows per tile and mean keys per step (tl.dot: 16 or more each)."""
    if torch.device(device).type == "cpu":
        return TEST_SIZES
    per_step = CHOICE_BLOCKS if topk <= 2 else 16
    rows = CHOICE_TILE // (per_step * max(topk - 1, 1))
    return max(16, min(CHOICE_ROWS, 1 << (rows.bit_length() - 1))), per_step


def _flags(q):
    return dict(IEEE=q.dtype == torch.float32, WIDEN=q.dtype == torch.bfloat16 and q.device.type == "cpu")


def _block_d(D):
    return max(16, 1 << (D - 1).bit_length())


@functools.cache
def triton_kernels():
    """The Triton kernels' module, imported on first use: Triton may be absent (span_available), and its
    interpreter reads TRITON_INTERPRET as the kernels are defined."""
    from attention.ops.moba import triton_kernels as kernels

    return kernels


def triton_choose(q, k, block: int, topk: int, docs=None):
    moba_choose_kernel = triton_kernels().moba_choose_kernel

    B, H, n, D = q.shape
    n_blocks = -(-n // block)
    means = block_means(k, block, docs)  # naive.py's: the same means to the bit
    chosen = torch.empty(B, H, n, topk, device=q.device, dtype=torch.long)
    rows, per_step = _choice_sizes(q.device, topk)
    moba_choose_kernel[(span_op.triton_cdiv(n, rows), B * H)](
        q, means, chosen, chosen if docs is None else docs, *q.stride()[:3], *means.stride()[:3], H, n, D,
        n_blocks, block, TOPK=topk, BLOCK_M=rows, BLOCK_C=per_step, BLOCK_D=_block_d(D), HAS_DOCS=docs is not None)
    return chosen


class PairTiles:
    """The (query, chosen block) pairs beyond each query's own block, sorted by (batch x head, block) and cut into
    tiles of `rows` pairs of one group, on the device with no host synchronisation: the grid is an upper bound
    (every group's last tile may be partial), and tiles past the real ones find no group and return at once.
    Built once per forward (moba_attention) and read by the forward and backward kernels alike: `packed` is an
    earlier build's packed() (empty: build it here)."""

    def __init__(self, chosen, block: int, rows: int, packed=None):
        B, H, n, topk = chosen.shape
        self.slots, self.n_blocks = topk - 1, -(-n // block)
        self.groups, self.pairs = B * H * self.n_blocks, B * H * n * (topk - 1)
        self.grid = -(-self.pairs // rows) + self.groups
        if packed is not None and packed.numel():
            self.tile_group, self.tile_start, self.pair_start, self.counts, order = packed.split(
                (self.grid, self.groups, self.groups, self.groups, self.pairs))
            self.order = order.to(torch.int32)
            return
        groups = self.groups
        others = chosen[..., 1:]
        bh = torch.arange(B * H, device=chosen.device).view(B, H, 1, 1)
        key = torch.where(others >= 0, bh.view(B, H, 1, 1) * self.n_blocks + others, groups).flatten()
        self.order = torch.argsort(key, stable=True).to(torch.int32)
        # scatter_add, not bincount (which reads the largest key back to the host to size its output)
        self.counts = torch.zeros(groups + 1, device=key.device, dtype=torch.long).scatter_add_(
            0, key, torch.ones_like(key))[:groups]
        tiles = -(-self.counts // rows)
        tile_end = tiles.cumsum(0)
        self.tile_start = tile_end - tiles
        self.pair_start = self.counts.cumsum(0) - self.counts
        self.tile_group = torch.searchsorted(tile_end, torch.arange(self.grid, device=chosen.device), right=True)

    def args(self):
        return (self.tile_group, self.tile_start, self.pair_start, self.counts, self.order)

    def packed(self) -> torch.Tensor:
        """The tiles as one int64 tensor (a custom op's argument, saved for the backward)."""
        return torch.cat((self.tile_group, self.tile_start, self.pair_start, self.counts, self.order.long()))


def pair_tiles(chosen, block: int) -> torch.Tensor:
    """PairTiles(...).packed() for the kernels on chosen's device, built once for a forward and its backward; empty
    where the kernels do not run (one block per query, or the reference standing in on the CPU)."""
    if chosen.shape[-1] == 1 or not _use_triton(chosen.device):
        return chosen.new_empty(0)
    return PairTiles(chosen, block, _sizes(chosen.device)[0]).packed()


@functools.lru_cache(maxsize=64)
def own_blocks(block: int, n: int, device: str) -> torch.Tensor:
    """The own blocks' spans (causal within fixed blocks: static_spans of FixedBlock) as the ops take them, packed
    into one int32 tensor (lo, hi, key_first, key_end along its row). Built by the layer's plan, outside compiled
    code (cached: every layer shares them): a CUDA graph's memory pool must hold no tensor that outlives a call,
    and a cache filled inside an op during a graph's warm-up would."""
    spans = static_spans(FixedBlock(block), n, 1, 0, str(device))
    return torch.cat((spans.lo, spans.hi, spans.key_first, spans.key_end), dim=1).contiguous()


def own_block_spans(own: torch.Tensor, n: int, docs) -> tuple:
    """own_blocks' (lo, hi, key_first, key_end), with docs one (lo, hi) per batch row (B, 1, n), each row's run
    starting where its document begins; the blocks' key_first and key_end still bound the rows reading each key
    (raising lo only removes some)."""
    groups = (own.shape[1] - 2 * n) // 2
    lo, hi, key_first, key_end = own.split((n, n, groups, groups), dim=1)
    if docs is None:
        return lo, hi, key_first, key_end
    lo = torch.maximum(lo, docs.to(lo.dtype))[:, None].contiguous()
    return lo, hi.expand_as(lo).contiguous(), key_first, key_end


def triton_forward(q, k, v, chosen, own, block: int, docs=None, tiles=None):
    moba_pairs_forward_kernel = triton_kernels().moba_pairs_forward_kernel

    B, H, n, D = q.shape
    lo, hi, _, _ = own_block_spans(own, n, docs)
    own_out, own_lse = span_op.triton_forward(q, k, v, lo, hi, None, None, 0.0, False)
    topk = chosen.shape[-1]
    if topk == 1:
        return own_out, own_lse
    rows, cols = _sizes(q.device)
    tiles = PairTiles(chosen, block, rows, tiles)
    out = torch.empty(tiles.pairs, D, device=q.device, dtype=torch.float32)  # the merge reads filled pairs only
    lse = torch.full((tiles.pairs,), -math.inf, device=q.device, dtype=torch.float32)
    docs_or_order = tiles.order if docs is None else docs  # never read without documents
    moba_pairs_forward_kernel[(tiles.grid,)](
        q, k, v, out, lse, *tiles.args(), docs_or_order, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], H, n, D,
        tiles.n_blocks, tiles.slots, block, 1.4426950408889634 / math.sqrt(D), tiles.groups,
        BLOCK_M=rows, BLOCK_N=cols, BLOCK_D=_block_d(D), HAS_DOCS=docs is not None, **_flags(q))
    result = span_op.layout_like_q(q)
    total = torch.empty_like(own_lse)
    triton_kernels().moba_merge_kernel[(span_op.triton_cdiv(n, rows), B * H)](
        own_out, own_lse, out, lse, result, total, *own_out.stride()[:3], *result.stride()[:3], H, n, D, topk - 1,
        BLOCK_M=rows, BLOCK_D=_block_d(D))
    return result, total


def triton_backward(grad, q, k, v, out, lse, chosen, own, block: int, docs=None, tiles=None):
    kernels = triton_kernels()

    B, H, n, D = q.shape
    grad = span_op.unit_stride(grad)
    delta = span_op.triton_delta(grad, out)
    dq, dk_own, dv_own = span_op.triton_backward(grad, q, k, v, out, lse, *own_block_spans(own, n, docs),
                                                 None, None, 0.0, False, delta=delta)
    topk = chosen.shape[-1]
    if topk == 1:
        return dq, dk_own, dv_own
    rows, cols = _sizes(q.device)
    tiles = PairTiles(chosen, block, rows, tiles)
    dq_pairs = torch.empty(tiles.pairs, D, device=q.device, dtype=torch.float32)  # read for chosen blocks only
    scales = (1 / math.sqrt(D), 1.4426950408889634 / math.sqrt(D))
    docs_or_order = tiles.order if docs is None else docs  # never read without documents
    kernels.moba_pairs_dq_kernel[(tiles.grid,)](
        q, k, v, grad, lse, delta, dq_pairs, *tiles.args(), docs_or_order, *q.stride()[:3], *k.stride()[:3],
        *v.stride()[:3], *grad.stride()[:3], H, n, D, tiles.n_blocks, tiles.slots, block, *scales, tiles.groups,
        BLOCK_M=rows, BLOCK_N=cols, BLOCK_D=_block_d(D), HAS_DOCS=docs is not None, **_flags(q))
    dk, dv = torch.empty_like(k), torch.empty_like(v)  # the own part's strides: read with the same ones
    assert dk.stride() == dk_own.stride() and dv.stride() == dv_own.stride()
    kernels.moba_pairs_dkdv_kernel[(tiles.n_blocks * span_op.triton_cdiv(block, cols), B * H)](
        q, k, v, grad, lse, delta, dk_own, dv_own, dk, dv, tiles.pair_start, tiles.counts, tiles.order,
        docs_or_order, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *grad.stride()[:3], *dk.stride()[:3],
        *dv.stride()[:3], H, n, D, tiles.n_blocks, tiles.slots, block, *scales,
        BLOCK_M=rows, BLOCK_N=cols, BLOCK_D=_block_d(D), HAS_DOCS=docs is not None, **_flags(q))
    kernels.moba_dq_merge_kernel[(span_op.triton_cdiv(n, rows), B * H)](
        dq, dq_pairs, chosen.contiguous(), *dq.stride()[:3], H, n, D, topk - 1, BLOCK_M=rows, BLOCK_D=_block_d(D))
    return dq, dk, dv


def _use_triton(device) -> bool:
    return torch.device(device).type == "cuda" or span_op.triton_on_cpu()


# ---- the custom ops --------------------------------------------------------------------------------------------

@torch.library.custom_op("efficient_attention::moba_choose", mutates_args=(), device_types=("cuda", "cpu"))
def moba_choose_op(q: torch.Tensor, k: torch.Tensor, block: int, topk: int,
                   docs: torch.Tensor | None = None) -> torch.Tensor:
    """moba_choose for queries at the keys' positions 0 .. n - 1 (a prompt, training)."""
    if _use_triton(q.device):
        return triton_choose(q, k, block, topk, docs)
    return moba_choose(q, k, torch.arange(q.shape[2], device=q.device), block, topk, docs)


@moba_choose_op.register_fake
def _(q, k, block, topk, docs=None):
    B, H, n, _ = q.shape
    return q.new_empty(B, H, n, topk, dtype=torch.long)


@torch.library.custom_op("efficient_attention::moba_forward", mutates_args=(), device_types="cuda")
def moba_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chosen: torch.Tensor, tiles: torch.Tensor,
                 own: torch.Tensor, block: int,
                 docs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """tiles: pair_tiles(chosen, block), built once for the forward and its backward (empty: built here); own:
    own_blocks(block, n, device)."""
    return triton_forward(q, k, v, chosen, own, block, docs, tiles)


@moba_forward.register_fake
def _(q, k, v, chosen, tiles, own, block, docs=None):
    B, H, n, _ = q.shape
    return span_op.layout_like_q(q), q.new_empty(B, H, n, dtype=torch.float32)


@torch.library.custom_op("efficient_attention::moba_backward", mutates_args=(), device_types="cuda")
def moba_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, chosen: torch.Tensor, tiles: torch.Tensor, own: torch.Tensor, block: int,
                  docs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return triton_backward(grad, q, k, v, out, lse, chosen, own, block, docs, tiles)


@moba_backward.register_fake
def _(grad, q, k, v, out, lse, chosen, tiles, own, block, docs=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@moba_forward.register_kernel("cpu")
def _cpu_forward(q, k, v, chosen, tiles, own, block, docs=None):
    simulate_cuda.ran("moba")
    if _use_triton(q.device):
        return triton_forward(q, k, v, chosen, own, block, docs, tiles)
    y, lse = moba_naive(q, k, v, chosen, block, docs)
    out = span_op.layout_like_q(q)
    out.copy_(y)
    return out, lse


@moba_backward.register_kernel("cpu")
def _cpu_backward(grad, q, k, v, out, lse, chosen, tiles, own, block, docs=None):
    simulate_cuda.ran("moba")
    if _use_triton(q.device):
        return triton_backward(grad, q, k, v, out, lse, chosen, own, block, docs, tiles)
    with simulate_cuda.autograd_in_kernel():
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        y, _ = moba_naive(*inputs, chosen, block, docs)
        dq, dk, dv = torch.autograd.grad(y, inputs, grad)
    return torch.empty_like(q).copy_(dq), torch.empty_like(k).copy_(dk), torch.empty_like(v).copy_(dv)


def _setup_context(ctx, inputs, output):
    q, k, v, chosen, tiles, own, block, docs = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, chosen, docs, tiles, own)
    ctx.block = block


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, chosen, docs, tiles, own = ctx.saved_tensors
    return (*moba_backward(grad_out, q, k, v, out, lse, chosen, tiles, own, ctx.block, docs), None, None, None, None,
            None)


moba_forward.register_autograd(_backward, setup_context=_setup_context)


def moba_attention(q, k, v, block: int, topk: int, docs=None, own=None):
    """MoBA of queries over the keys at the same positions 0 .. n - 1 (training, a prompt): q, k, v (B, H, n, D),
    docs (B, n) or None (naive.py); the output (B, H, n, D), laid out (B, n, H, D) in memory. own:
    own_blocks(block, n, device), as the layer's plan built it (None: looked up here, in eager code only)."""
    q, k, v = (span_op.unit_stride(t) for t in (q, k, v))
    if docs is not None:
        docs = docs.contiguous()  # the kernels read it as rows of n
    chosen = moba_choose_op(q, k, block, topk, docs)
    own = own_blocks(block, q.shape[2], str(q.device)) if own is None else own
    out, _ = moba_forward(q, k, v, chosen, pair_tiles(chosen, block), own, block, docs)
    return out


def _samples():
    generator = torch.Generator().manual_seed(0)
    B, H, n, D, block = 2, 2, 40, 16, 8
    # documents from 0, 13, 14 (one token) and 30 in the first row; the second row one document
    marks = torch.zeros(B, n, dtype=torch.long)
    marks[0, [13, 14, 30]] = 1
    samples = []
    for dtype in (torch.float32, torch.bfloat16):
        for docs in (None, document_starts(marks, 1, torch.arange(n))):
            q, k, v = (torch.randn(B, n, H, D, generator=generator).to(dtype).transpose(1, 2) for _ in range(3))
            samples.append((q, k, v, moba_choose(q, k, torch.arange(n), block, 2, docs), block, docs))
    return samples


@simulate_cuda.opcheck_samples("efficient_attention::moba_choose")
def _choose_samples():
    return [(q, k, block, 2, docs) for q, k, v, _, block, docs in _samples()]


@simulate_cuda.opcheck_samples("efficient_attention::moba_forward")
def _forward_samples():
    # with the pairs' tiles built beforehand (as moba_attention passes them) and without (built inside)
    return [(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), chosen,
             PairTiles(chosen, block, TEST_SIZES[0]).packed() if i % 2 else chosen.new_empty(0),
             own_blocks(block, q.shape[2], "cpu"), block, docs)
            for i, (q, k, v, chosen, block, docs) in enumerate(_samples())]


@simulate_cuda.opcheck_samples("efficient_attention::moba_backward")
def _backward_samples():
    samples = []
    for i, (q, k, v, chosen, block, docs) in enumerate(_samples()):
        tiles = PairTiles(chosen, block, TEST_SIZES[0]).packed() if i % 2 else chosen.new_empty(0)
        own = own_blocks(block, q.shape[2], "cpu")
        out, lse = _cpu_forward(q, k, v, chosen, tiles, own, block, docs)
        grad = torch.randn(out.shape[0], out.shape[2], out.shape[1], out.shape[3]).to(q.dtype).transpose(1, 2)
        samples.append((grad, q, k, v, out, lse, chosen, tiles, own, block, docs))
    return samples
