"""Attention kernels over an edge rule (attention/edges.py).

    dense    reference: explicit (B, H, Tq, Tk) scores in float32 or better, any device, O(n^2)
    chunked  block-sparse, O(edges) time and memory with autograd on any device (the CPU training path): queries
             in chunks of c, each attending to the keys that hold its allowed edges (ChunkTiles, from a scan of
             the rule's edges over its key_ranges): a sliding window's band of key chunks, else the chunk's
             keys compacted (own block, summary columns, sinks, global tokens), gathered by index. Plain
             softmax on CPU runs groups of tiles through
             PyTorch's fused CPU flash kernel, forward and backward (ChunkedFlashCPU), sigmoid attention runs
             ChunkedSigmoid on any device (both take a ScoreBias); elsewhere all tiles go through one batched
             SDPA call, or explicit math for other score_mods
    windows  chosen by the other backends for rules made of disjoint windows (EdgeRule.window_tiles: paper
             004's bridge path): one batched SDPA call over one tile per window, its rows by its keys
    span     (CUDA, the default there for rules whose edges are spans) attention/ops/span: Triton kernels in which
             every query row attends one contiguous run of keys per head (sliding windows, multi-scale windows,
             blocks, the bridges' windows and their union with the blocks, stochastic attention's band in slot
             order), softmax or sigmoid, with ALiBi computed in the kernel: a tile costs its rows' spans
    flex     FlexAttention with a block mask built once per (rule, length) from the same block structure and
             shared by all layers; compiled on CUDA; forward-only on CPU (torch 2.13 has no CPU backward for it),
             except on the CPU standing in for CUDA (attention/simulate_cuda.py: compiled with aot_eager, whose
             reference implementation runs forward and backward)
    sdpa     PyTorch's fused SDPA: is_causal for the causal rule, else a dense boolean mask (O(n^2) memory)

auto picks sdpa for plain causal attention only; on CUDA (and on the CPU standing in for it) span for every rule
whose edges are spans, with no score_mod or an ALiBi one, when Triton is installed, else flex; chunked elsewhere.

Layouts (attention/layouts.py): heads whose allowed offsets all share a divisor d > 1 (dilated, strided rules)
run each residue class mod d as a sequence of its own, found from the rule (or its residue_classes); the
chunked kernel reads such a layout's rows as strided views, FlexAttention runs on the rows gathered. Keys a
query block attends only sparsely (a summary column) are read by FlexAttention from a prefix of copies
(key_prefix). A rule with a score_mod, or a call from a position offset, keeps the tokens' order.

Every kernel takes the same optional `score_mod(score, b, h, q_idx, kv_idx)` (FlexAttention's signature, over
absolute positions, so one definition serves all backends) and `activation` ("softmax" or "sigmoid": no
normalisation), for variants that add position biases or change the score nonlinearity. A score_mod that is a
`ScoreBias` (an additive bias from head and positions only, such as ALiBi) stays on the fused paths: the CPU
flash kernel takes it in its additive mask, and sigmoid attention runs ChunkedSigmoid (groups of chunks, a
hand-written backward) on the chunked backend and FlexAttention's softmax of log-sigmoid scores rescaled
by exp(lse) on flex.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attention import simulate_cuda
from attention.edges import Causal, EdgeRule
from attention.layouts import KeyPrefixRule, Layout, from_layout, layout_groups, to_layout, write_rows
from attention.ops.span.op import span_attention, span_blocks, triton_installed
from attention.ops.span.spans import Spans, band_spans, span_scores, spans_problem, static_spans

BACKENDS = ("auto", "dense", "chunked", "flex", "sdpa", "span")
TILE_ROWS_PER_CALL = 16384  # chunked kernel on CPU: batch x heads x query positions per fused call
WIDTH_SPREAD = 1.25  # compacted tiles: a segment's widest chunk at most this many times its narrowest


class ScoreBias:
    """A score_mod that adds bias(h, q_idx, kv_idx) to every score, independent of the score and the batch
    (ALiBi and other position biases). It is an ordinary FlexAttention score_mod; kernels that can add a
    precomputed bias tile (the fused CPU paths) recognise it and keep their fast path. `relative`: the bias
    depends on q_idx - kv_idx only, so one tile serves every chunk."""

    relative = False

    def bias(self, h, q_idx, kv_idx):
        raise NotImplementedError

    def alibi(self):
        """(slopes (H,) float32, offset) when the bias is slopes[h] (q - k) + offset, which span attention computes
        inside its kernel; None for any other bias."""
        return None

    def __call__(self, score, b, h, q_idx, kv_idx):
        return score + self.bias(h, q_idx, kv_idx)


FLEX_MIN_HEAD_DIM = 16  # torch 2.13's CUDA FlexAttention lowering needs head_dim >= 16


def resolve_backend(name: str, rule: EdgeRule, device: torch.device, head_dim: int = 64) -> str:
    if name != "auto":
        return name
    if type(rule) is Causal:  # plain causal attention: the fused kernels' own causal path
        return "sdpa"
    # every other rule runs block-sparse at the cost of its edges: compiled FlexAttention on CUDA (and on the CPU
    # standing in for it: attention/simulate_cuda.py), the chunked kernel elsewhere (and on CUDA below
    # FlexAttention's smallest head dimension)
    if simulate_cuda.gpu_path(device) and span_available() and not spans_problem(rule):
        return "span"
    flex_ok = simulate_cuda.gpu_path(device) and head_dim >= FLEX_MIN_HEAD_DIM
    return "flex" if flex_ok else "chunked"


def span_available() -> bool:
    """Whether span attention's kernels can run: Triton installed (on CUDA; its interpreter or the reference on
    the CPU standing in for it)."""
    return triton_installed() or simulate_cuda.stand_ins()


def _span_bias(score_mod):
    """(slopes, offset) of an ALiBi score_mod for span attention, (None, 0.0) without one, None for other score_mods."""
    if score_mod is None:
        return None, 0.0
    return score_mod.alibi() if isinstance(score_mod, ScoreBias) else None


def _windowed(rule: EdgeRule) -> bool:
    """Whether the rule defines disjoint windows (EdgeRule.window_tiles: paper 004's bridge path)."""
    return type(rule).window_tiles is not EdgeRule.window_tiles


@dataclass(eq=False)
class AttentionPlan:
    """A resolved kernel and everything it needs that depends only on the rule, the length, the heads and the
    device: tile masks, window tiles, FlexAttention block masks, the score_mod in the kernel's form.

    Plans are built outside compiled code (Mixer.plan, called by GPT.forward before the blocks run), so a
    compiled block receives its masks as inputs instead of rebuilding them in its graph at every forward, and
    its graph has no data-dependent branch on them (e.g. whether a row has no key is decided here). The
    expensive parts are cached per (rule, length, device): every layer with the same rule shares them.

    kernel: window | chunked | flex | sdpa | dense. data: window: _window_plan's tensors; chunked: a tuple of
    (first head, end head, ChunkTiles), one per group of heads; flex: a BlockMask; sdpa: a dense boolean
    mask, or None for causal attention from position 0; dense: None. cpu_flash: whether the chunked kernel
    takes the CPU's fused flash kernel (not on CUDA, nor on the CPU standing in for it: decided here, outside
    compiled code, so that a compiled block's branch is one of its guarded inputs).
    """

    kernel: str
    rule: EdgeRule
    n: int
    start: int = 0
    score_mod: object = None
    activation: str = "softmax"
    data: object = None
    cpu_flash: bool = True


def plans_in(plan) -> list[AttentionPlan]:
    """The AttentionPlans inside what a Mixer.plan returned (one, a tuple of paths, sa's permutation plans, ...):
    which kernels a layer runs, for tools and tests."""
    if isinstance(plan, AttentionPlan):
        return [plan]
    if isinstance(plan, (tuple, list)):
        return [p for item in plan for p in plans_in(item)]
    if dataclasses.is_dataclass(plan) and not isinstance(plan, type):
        return [p for field in dataclasses.fields(plan) for p in plans_in(getattr(plan, field.name))]
    return []


@dataclass(eq=False)
class ChunkTiles:
    """The block-sparse kernel's tiles over n positions: chunks of `chunk` queries, each over the keys that
    hold an allowed edge of some query of the chunk, in one of two layouts:

        band       (a sliding window's) key_chunks[i] (S of them, -1 outside the sequence) are chunks
                   i - band .. i - band + S - 1: each tile is a slice of the keys, and relative position biases
                   have the same tile everywhere
        compacted  (every other rule) key_index[i] are the positions of the keys chunk i's queries attend, the
                   union of their edges (own block, summary columns, sinks, global tokens), padded with n (a
                   zero row); widths[i] how many are real. Tiles are gathered by index, each group of chunks
                   as wide as its widest chunk

    `segments` are runs of chunks (first, end, mask, closed) whose tiles are stored at one width: a band is one
    segment; compacted chunks are cut where their widths part by more than WIDTH_SPREAD, so that a few wide
    chunks (the rows of global tokens) never widen the others' stored masks (n x n for a rule with a dense row).
    `mask` (s, c, K) or per head (H, s, c, K) are the allowed pairs of a segment's tiles (K = S c or its widest
    chunk), `closed` the pairs the fused softmax kernel masks out (outside the edges, except in rows without any:
    opened everywhere, their outputs are zeroed); `keep` is None when every query has an allowed key, else a 0/1
    factor (n, 1) or (H, n, 1) that zeroes the rows without one."""

    segments: tuple
    chunk: int
    key_chunks: torch.Tensor | None
    band: int | None
    keep: torch.Tensor | None
    key_index: torch.Tensor | None = None
    widths: tuple = ()

    @property
    def n_chunks(self) -> int:
        return self.segments[-1][1]

    @property
    def device(self):
        return self.segments[0][2].device

    @property
    def slots(self) -> int:
        return self.key_chunks.shape[1]

    def tile_mask(self, i0: int, i1: int, width: int, closed: bool = False) -> torch.Tensor:
        """The mask (or closed pairs) of chunks i0..i1 - 1, which lie in one segment, over their first `width`
        keys: (..., i1 - i0, c, width)."""
        for first, end, mask, closed_pairs in self.segments:
            if first <= i0 < end:
                return (closed_pairs if closed else mask)[..., i0 - first:i1 - first, :, :width]
        raise IndexError(f"chunk {i0} is outside the tiles' {self.n_chunks} chunks")

    @property
    def mask(self) -> torch.Tensor:
        """Every chunk's mask, padded to the widest (tests; the kernels read segments)."""
        width = max(m.shape[-1] for _, _, m, _ in self.segments)
        return torch.cat([F.pad(m, (0, width - m.shape[-1])) for _, _, m, _ in self.segments], -3)

    def scores(self, n: int, heads: int = 1) -> int:
        """Scores the kernel evaluates per head over n queries of a batch of one with `heads` heads (query rows
        past the end not counted; compacted tiles are as wide as each call's widest chunk)."""
        c, nc = self.chunk, self.n_chunks
        rows = [min(c, n - i * c) for i in range(nc)]
        if self.band is not None:
            slots = (self.key_chunks.cpu() >= 0).sum(1).tolist()
            return sum(r * s * c for r, s in zip(rows, slots))
        return sum(sum(rows[g.i0:g.i1]) * g.width for g in ChunkedFlashCPU._groups(n, self, heads))


def plan_attention(rule: EdgeRule, backend: str, n: int, n_head: int, head_dim: int, device, start: int = 0,
                   score_mod=None, activation: str = "softmax", chunk: int = 0) -> AttentionPlan:
    """The plan attend_planned runs for attention of n queries at positions start.. under rule (see
    AttentionPlan). Call it outside compiled code; it refuses to run while torch.compile traces."""
    if activation not in ("softmax", "sigmoid"):
        raise ValueError(f"unknown attention activation {activation!r}: expected softmax or sigmoid")
    device = str(device)
    kernel = resolve_backend(backend, rule, torch.device(device), head_dim)
    if kernel not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if kernel == "span":
        bias = _span_bias(score_mod)
        spans = _plan_spans(rule, n, n_head, start, device) if bias is not None else None
        if spans is not None:
            slopes, offset = bias
            return AttentionPlan("span", rule, n, start, score_mod, activation,
                                 SpanPlan(spans, None if slopes is None else slopes.to(device).float(), float(offset)),
                                 cpu_flash=False)
        if backend == "span":
            raise ValueError(f"attn_backend=span: {spans_problem(rule) or 'a score_mod other than ALiBi'} "
                             f"({type(rule).__name__}); use auto, flex, chunked or dense")
        kernel = "flex" if head_dim >= FLEX_MIN_HEAD_DIM else "chunked"  # auto: the next best
    plan = AttentionPlan(kernel, rule, n, start, score_mod, activation, cpu_flash=not simulate_cuda.gpu_path(device))
    if kernel == "dense":
        return plan
    if kernel == "sdpa":
        if score_mod is not None or activation != "softmax":
            raise ValueError("attn_backend=sdpa supports plain softmax attention only; use dense, chunked or flex")
        if not (isinstance(rule, Causal) and start == 0):
            _refuse_while_compiling("sdpa's dense mask")
            pos = torch.arange(start, start + n, device=device)
            plan.data = rule.dense_mask(pos, n_head=n_head)
        return plan
    _refuse_while_compiling(f"the {kernel} kernel's masks")
    if _windowed(rule) and start == 0 and score_mod is None and activation == "softmax":
        plan.kernel, plan.data = "window", _window_plan(rule, n, device)
    elif kernel == "chunked":
        tiles_of = _cached_chunk_tiles if rule.static else _chunk_tiles  # a permutation's tiles are its own
        plan.data = tuple(HeadGroup(tuple(heads), sub_rule, tiles_of(sub_rule, n, start, chunk or sub_rule.chunk_size(),
                                                                     len(heads), device), layout)
                          for heads, sub_rule, layout in _head_groups(rule, n, n_head, device, start, score_mod))
    else:  # flex
        if simulate_cuda.simulated(device):  # before any block that calls flex_attention is traced
            simulate_cuda.allow_flex_cpu_backward()
        in_order = not _may_reorder(rule, start, score_mod)
        groups = [(heads, sub_rule, layout, None if in_order or layout is not None else
                   key_prefix(sub_rule, n, len(heads)))
                  for heads, sub_rule, layout in _head_groups(rule, n, n_head, device, start, score_mod)]
        if all(layout is None and keys is None for _, _, layout, keys in groups):
            plan.data = flex_block_mask(rule, n, n_head, device, start)
        else:  # each group in its own layout or key order, under its block mask there
            plan.data = tuple(_flex_group(heads, sub_rule, layout, keys, n, device)
                              for heads, sub_rule, layout, keys in groups)
        plan.score_mod = _flex_score_mod(score_mod, start, activation)
    return plan


@dataclass(eq=False)
class SpanPlan:
    """Span attention's data: the rule's spans (attention/ops/span/spans.py) and its ALiBi bias, if any."""

    spans: Spans
    slopes: torch.Tensor | None = None
    offset: float = 0.0


def _plan_spans(rule: EdgeRule, n: int, n_head: int, start: int, device: str) -> Spans | None:
    if spans_problem(rule):
        return None
    if not rule.static:
        if start:
            return None
        return band_spans(rule, n, device)
    _refuse_while_compiling("span attention's spans")
    return static_spans(rule, n, n_head, start, device)


@dataclass(eq=False)
class HeadGroup:
    """Heads a kernel runs together at their own cost: their rule (over their layout's rows when they have
    one), the kernel's data for it (ChunkTiles, or a BlockMask for flex), their layout (None: the tokens' own
    order) and, for flex, the gather index of their keys (key_prefix; None: the keys as they are)."""

    heads: tuple
    rule: EdgeRule
    data: object
    layout: Layout | None = None
    key_index: torch.Tensor | None = None


def _flex_group(heads, rule, layout, keys, n, device) -> HeadGroup:
    if keys is not None:
        rule = KeyPrefixRule(rule, keys.prefix_keys.to(device), keys.from_prefix.to(device), FLEX_BLOCK)
        return HeadGroup(tuple(heads), rule, flex_block_mask(rule, n, len(heads), device), None,
                         keys.index.to(device))
    return HeadGroup(tuple(heads), rule, flex_block_mask(rule, n, len(heads), device), layout)


@dataclass(eq=False)
class KeyPrefix:
    """FlexAttention's compacted key order (KeyPrefixRule): the keys gathered by `index` (the prefix copies,
    -1 padding read as key 0, then every key in order)."""

    prefix_keys: torch.Tensor
    from_prefix: torch.Tensor
    index: torch.Tensor


SPARSE_KEYS = 16  # a key block of which a query block attends at most this many keys is read from the prefix


@functools.lru_cache(maxsize=64)
def key_prefix(rule: EdgeRule, n: int, n_head: int) -> KeyPrefix | None:
    """FlexAttention's compacted order for a static rule: copies of the keys that query blocks attend only
    sparsely in a key block (a summary column's key in every earlier block, sinks) in a prefix of whole
    blocks, when that leaves fewer blocks to compute (a block mask pays for every key block that holds one
    edge); None otherwise. The chunked kernel compacts every chunk's keys exactly instead (ChunkTiles)."""
    if not rule.static:
        return None
    size = FLEX_BLOCK
    nb = -(-n // size)
    copied = torch.zeros(nb, nb, dtype=torch.bool)
    keys = torch.zeros(n, dtype=torch.bool)
    blocks_before = 0
    for first, slots, used in _used_keys(rule, n, size, n_head):
        per_block = used.view(len(slots), -1, size)  # (g, S, size)
        counts = per_block.sum(-1)
        blocks_before += int((counts > 0).sum())
        sparse = (counts > 0) & (counts <= SPARSE_KEYS)
        rows = (first + torch.arange(len(slots)))[:, None].expand_as(slots)
        copied[rows[sparse], slots[sparse]] = True
        positions = (slots[:, :, None] * size + torch.arange(size)).clamp(0, n - 1)
        keys[positions[sparse[:, :, None] & per_block]] = True
    count = int(keys.sum())
    if count == 0:
        return None
    padded = -(-count // size) * size
    prefix_keys = torch.full((padded,), -1, dtype=torch.long)
    prefix_keys[:count] = torch.nonzero(keys).flatten()
    blocks_after = blocks_before - int(copied.sum()) + int(copied.any(1).sum()) * (padded // size)
    if blocks_after >= 0.9 * blocks_before:
        return None
    index = torch.cat([prefix_keys.clamp(min=0), torch.arange(n)])
    return KeyPrefix(prefix_keys, copied, index)


def _may_reorder(rule: EdgeRule, start: int, score_mod) -> bool:
    """Whether a plan may run in another order of queries or keys: a static rule from position 0 (a cached
    prefill's offset keeps the tokens' order), without a score_mod (it sees positions)."""
    return rule.static and start == 0 and score_mod is None


def _head_groups(rule: EdgeRule, n: int, n_head: int, device: str, start: int, score_mod) -> tuple:
    """(heads, rule, layout) per group of heads: the rule's head groups, each static rule's heads split by the
    residue-class layout their edges have (attention/layouts.py). A score_mod sees positions, so rules with one
    and calls from a position offset (cached prefill) run in the tokens' order."""
    if _may_reorder(rule, start, score_mod):
        return layout_groups(rule, n, n_head, device)
    groups = rule.head_groups()
    if not groups or len(groups) == 1:
        groups = [(list(range(n_head)), rule)]
    return tuple((heads, sub_rule, None) for heads, sub_rule in groups)


def computed_scores(plan: AttentionPlan, n_head: int) -> int:
    """The attention scores a plan's kernel computes over all heads: every tile or block it evaluates, allowed
    edges and masked ones alike (what it costs), against which a rule's allowed edges (EdgeRule.count_edges)
    show whether its cost follows them. Query rows past the sequence's end are not counted."""
    n, keys = plan.n, plan.start + plan.n
    if plan.kernel == "dense" or (plan.kernel == "sdpa" and plan.data is not None):
        return n_head * n * keys
    if plan.kernel == "sdpa":  # causal from position 0: the fused kernels skip the tiles above the diagonal
        return n_head * n * (n + 1) // 2
    if plan.kernel == "window":
        q_index, k_index, mask, rows = plan.data
        return n_head * len(rows) * mask.shape[-1]
    if plan.kernel == "span":
        return span_scores(plan.data.spans, n_head, *span_blocks("cuda"))
    if plan.kernel == "chunked":
        return sum(len(group.heads) * group.data.scores(n, len(group.heads)) for group in plan.data)
    if plan.kernel == "flex":
        if isinstance(plan.data, tuple):
            return sum(_flex_scores(group.data, len(group.heads)) for group in plan.data)
        return _flex_scores(plan.data, n_head)
    raise ValueError(f"no score count for the {plan.kernel} kernel")


def _flex_scores(mask, n_head: int) -> int:
    blocks = mask.kv_num_blocks + (mask.full_kv_num_blocks if mask.full_kv_num_blocks is not None else 0)
    per_head = int(blocks.sum()) * (1 if blocks.shape[1] == n_head else n_head) // max(1, blocks.shape[0])
    q_block, kv_block = mask.BLOCK_SIZE
    return per_head * q_block * kv_block


def layer_scores(mixer, seq_len: int, device="cpu") -> tuple[str, float | None]:
    """(the kernels a layer's forward runs, the scores they compute per head): computed_scores over the layer's
    own plan on that device. None for a mixer that plans no attention kernel (the recurrent mixers; moba, whose
    kernel computes its chosen blocks)."""
    with torch.random.fork_rng(devices=[]):  # sa draws a permutation: any draw has the same tiles, and the
        plans = plans_in(mixer.plan(1, seq_len, device))  # caller's random stream is left as it was
    if not plans:
        return "its own kernel", None
    heads = getattr(mixer, "n_head", 1)
    return "+".join(dict.fromkeys(p.kernel for p in plans)), sum(computed_scores(p, heads) for p in plans) / heads


def _refuse_while_compiling(what: str) -> None:
    if torch.compiler.is_compiling():
        raise RuntimeError(f"{what} would be built inside a compiled graph (at every forward of every layer): plan "
                           "attention outside compiled code (GPT.forward does, through Mixer.plan) and pass the plan in")


def attend(q, k, v, rule: EdgeRule, backend: str, start: int = 0, score_mod=None, activation="softmax",
           dropout_p: float = 0.0, chunk: int = 0, plan: AttentionPlan | None = None):
    """Attention of q over k, v (B, H, T, D) at positions start..start+T-1 under rule, with one backend (or the
    given plan, built by plan_attention for these arguments)."""
    if plan is None:
        plan = plan_attention(rule, backend, q.shape[2], q.shape[1], q.shape[3], q.device, start, score_mod,
                              activation, chunk)
    return attend_planned(q, k, v, plan, dropout_p)


def repeat_kv(q, k, v):
    """Grouped-query attention's k and v (B, H_kv, T, D) repeated to q's heads (each k/v head serves
    H / H_kv consecutive query heads), for kernels that take one k/v head per query head."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def attend_planned(q, k, v, plan: AttentionPlan, dropout_p: float = 0.0):
    """Run a plan from plan_attention on q (B, H, n, D) and k, v (B, H or fewer, n, D: grouped-query attention,
    which SDPA and FlexAttention take as it is and the other kernels with k and v repeated)."""
    rule, start, score_mod, activation = plan.rule, plan.start, plan.score_mod, plan.activation
    if plan.kernel == "span":
        if dropout_p > 0:
            raise ValueError("span attention has no attention dropout: set dropout=0 or use attn_backend=chunked")
        data = plan.data
        return span_attention(q, k, v, data.spans, data.slopes, data.offset, activation == "sigmoid")
    if plan.kernel not in ("sdpa", "flex"):
        k, v = repeat_kv(q, k, v)
    if plan.kernel == "window":
        return window_attention(q, k, v, rule, dropout_p, plan.data)
    if plan.kernel == "dense":
        pos = torch.arange(start, start + q.shape[2], device=q.device)
        return dense_attention(q, k, v, rule, pos, score_mod=score_mod, activation=activation, dropout_p=dropout_p)
    if plan.kernel == "chunked":
        groups = plan.data
        if len(groups) == 1 and groups[0].layout is None:
            return chunked_attention(q, k, v, rule, start, 0, score_mod, activation, dropout_p, tiles=groups[0].data,
                                     cpu_flash=plan.cpu_flash)
        # each head group at its own cost (its window, its layout), not the largest one's
        order = [i for group in groups for i in group.heads]
        in_order = order == list(range(q.shape[1]))
        if in_order and _fusable(score_mod) and activation == "softmax" and dropout_p == 0.0 \
                and q.device.type == "cpu" and plan.cpu_flash:
            # one fused call writing every group into the output, each group's tiles read through its layout
            bounds, first = [], 0
            for group in groups:
                bounds.append((first, first + len(group.heads), group.data, group.layout))
                first += len(group.heads)
            return ChunkedFlashCPU.apply(q, k, v, tuple(bounds), score_mod, start)

        def run(q_g, k_g, v_g, group):
            return chunked_attention(q_g, k_g, v_g, group.rule, start, 0,
                                     _head_subset(score_mod, group.heads, q.device), activation, dropout_p,
                                     tiles=group.data, cpu_flash=plan.cpu_flash)
        return _per_group(q, k, v, groups, run)
    if plan.kernel == "flex":
        if isinstance(plan.data, tuple):  # head groups in layouts or key orders of their own
            k, v = repeat_kv(q, k, v)
            return _per_group(q, k, v, plan.data, lambda q_g, k_g, v_g, group: flex(  # score_mod: flex's form
                q_g, k_g, v_g, group.rule, 0, score_mod, activation, dropout_p, block_mask=group.data))
        return flex(q, k, v, rule, start, score_mod, activation, dropout_p, block_mask=plan.data)
    if plan.kernel == "sdpa":
        if plan.data is None:
            return _sdpa(q, k, v, dropout_p=dropout_p, is_causal=True)
        return _fused_softmax(q, k, v, plan.data, dropout_p)
    raise ValueError(f"unknown attention kernel {plan.kernel!r}")


def _per_group(q, k, v, groups, run):
    """run(q, k, v, group) over every HeadGroup's heads, in its layout, joined in head order."""
    order = [i for group in groups for i in group.heads]
    in_order = order == list(range(q.shape[1]))
    if in_order:  # consecutive groups: split, whose backward is one concatenation (no zero-filled
        sizes = [len(group.heads) for group in groups]  # full-size gradient per group, as indexing has)
        pieces = zip(q.split(sizes, 1), k.split(sizes, 1), v.split(sizes, 1))
    else:
        index = [torch.tensor(group.heads, device=q.device) for group in groups]
        pieces = ((q[:, h], k[:, h], v[:, h]) for h in index)
    parts = []
    for (q_g, k_g, v_g), group in zip(pieces, groups):
        if group.key_index is not None:  # keys with a prefix of copies, queries as they are
            k_g, v_g = k_g.index_select(2, group.key_index), v_g.index_select(2, group.key_index)
        if group.layout is None:
            parts.append(run(q_g, k_g, v_g, group))
        else:
            parts.append(from_layout(run(*(to_layout(t, group.layout) for t in (q_g, k_g, v_g)), group),
                                     group.layout))
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return y if in_order else y[:, torch.argsort(torch.tensor(order, device=q.device))]


def _fusable(score_mod) -> bool:
    """Whether the fused chunked kernels can take score_mod (none, or an additive ScoreBias)."""
    return score_mod is None or isinstance(score_mod, ScoreBias)


def _head_subset(score_mod, heads, device):
    """score_mod for a subset of heads: local head index i is global head heads[i]."""
    if score_mod is None:
        return None
    heads = torch.tensor(heads, device=device)
    return lambda score, b, h, q_idx, kv_idx: score_mod(score, b, heads[h], q_idx, kv_idx)


def _apply_score_mod(scores, score_mod, q_pos, k_pos):
    """scores (B, H, ..., Tq, Tk); q_pos (..., Tq, 1) and k_pos (..., 1, Tk) broadcast against its tail."""
    B, H = scores.shape[:2]
    extra = scores.dim() - 2
    b = torch.arange(B, device=scores.device).view(B, *([1] * (extra + 1)))
    h = torch.arange(H, device=scores.device).view(1, H, *([1] * extra))
    return score_mod(scores, b, h, q_pos, k_pos)


def masked_attention(q, k, v, mask, q_pos=None, k_pos=None, score_mod=None, activation="softmax",
                     dropout_p: float = 0.0, fused: bool = True):
    """Attention of q over k, v under a boolean mask broadcastable to (B, H, Tq, Tk) (or tiles of it).

    fused: plain softmax goes through SDPA; otherwise explicit math in float32 (float64 for float64 inputs; under
    autocast its matmuls in the autocast dtype), where a query with no allowed key gets a zero output (never NaN).
    """
    if fused and score_mod is None and activation == "softmax":
        return _fused_softmax(q, k, v, mask, dropout_p)
    k, v = repeat_kv(q, k, v)
    compute = torch.promote_types(q.dtype, torch.float32)  # at least float32, float64 when given
    scores = (q.to(compute) @ k.to(compute).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if score_mod is not None:
        scores = _apply_score_mod(scores, score_mod, q_pos.unsqueeze(-1), k_pos.unsqueeze(-2))
    if activation == "softmax":
        # the finite minimum (not -inf) keeps rows without any allowed key at exactly zero instead of NaN; of the
        # scores' dtype, which autocast makes its own
        probs = torch.softmax(scores.masked_fill(~mask, torch.finfo(scores.dtype).min), dim=-1) * mask
    elif activation == "sigmoid":
        probs = torch.sigmoid(scores) * mask
    else:
        raise ValueError(f"unknown attention activation {activation!r}: expected softmax or sigmoid")
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return (probs @ v.to(compute)).to(q.dtype)


def _sdpa(q, k, v, **options):
    """F.scaled_dot_product_attention (grouped keys as needed); its output is laid out as CUDA's kernels lay it
    out (not contiguous) on CUDA and on the CPU standing in for it."""
    y = F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1], **options)
    return simulate_cuda.sdpa_output_layout(y) if simulate_cuda.simulated(q.device) else y


def _fused_softmax(q, k, v, mask, dropout_p=0.0):
    """SDPA under a boolean mask; a query with no allowed key gets a zero output, as in the explicit path.

    (SDPA alone returns NaN for such rows: here they attend to every key and their output is zeroed.)
    """
    has_key = mask.any(-1, keepdim=True)  # applied unconditionally: a data-dependent branch would sync GPUs
    y = _sdpa(q, k, v, attn_mask=mask | ~has_key, dropout_p=dropout_p)
    return y * has_key


def dense_attention(q, k, v, rule: EdgeRule, q_pos, k_pos=None, key_valid=None, score_mod=None,
                    activation="softmax", dropout_p: float = 0.0, fused: bool = False):
    """The reference: explicit scores over all (query, key) pairs, masked by the rule."""
    k_pos = q_pos if k_pos is None else k_pos
    mask = rule.dense_mask(q_pos, k_pos, n_head=q.shape[1])
    if key_valid is not None:
        mask = mask & key_valid
    return masked_attention(q, k, v, mask, q_pos, k_pos, score_mod, activation, dropout_p, fused=fused)


def window_attention(q, k, v, rule: EdgeRule, dropout_p: float = 0.0, tiles=None):
    """Softmax attention under a rule made of disjoint windows (EdgeRule.window_tiles), one (rows x keys) tile per
    window, batched in one SDPA call: the cost is the windows' tiles, whatever n. Rows outside every window get
    zero. The tiles' mask is the rule's allowed() at their positions. tiles: _window_plan(rule, n, device)."""
    B, H, n, D = q.shape
    q_index, k_index, mask, rows = _window_plan(rule, n, str(q.device)) if tiles is None else tiles
    J, R, K = mask.shape
    if J == 0:  # a sequence shorter than the first window's rows
        return q * 0  # zero, with q's graph
    tiles = lambda x, index, size: x.index_select(2, index).view(B, H * J, size, D)  # noqa: E731
    y = _fused_softmax(tiles(q, q_index, R), tiles(k, k_index, K), tiles(v, k_index, K),
                       mask.expand(H, J, R, K).reshape(H * J, R, K), dropout_p)
    y = y.reshape(B, H, J * R, D).index_select(2, rows)  # the tiles' rows inside the sequence, in order
    return q.new_zeros(B, H, n, D).index_copy(2, q_index.view(J * R).index_select(0, rows), y)


@functools.lru_cache(maxsize=64)
def _window_plan(rule: EdgeRule, n: int, device: str):
    """Row and key positions of every window's tile (clamped into the sequence), the tiles' mask, and which
    tile rows lie inside the sequence and are written back; built once per (rule, length, device), on the CPU
    (no device sync)."""
    first_row, first_key, R, K = rule.window_tiles(n)
    q_pos = first_row[:, None] + torch.arange(R)  # (J, R)
    k_pos = first_key[:, None] + torch.arange(K)  # (J, K)
    mask = rule.allowed(q_pos[:, :, None], k_pos[:, None, :]) & (k_pos < n)[:, None, :]
    # rows past the end or not written back by their window (the bridge kind's pre-boundary half at the
    # configured context's end): any key keeps the fused kernel's rows non-empty; their output stays zero
    dropped = (q_pos >= n) | ~mask.any(-1)
    mask = mask | dropped[:, :, None]
    rows = torch.nonzero(~dropped.flatten()).flatten()
    to = lambda t: t.to(device)  # noqa: E731
    return to(q_pos.clamp(max=n - 1).flatten()), to(k_pos.clamp(max=n - 1).flatten()), to(mask), to(rows)


class KeyTiles(torch.autograd.Function):
    """Key (or value) tiles of a _TileGroup's chunks, with a backward that adds each tile slot's gradient back
    onto its chunk in place (autograd through the gather would allocate a full-size buffer per slot)."""

    @staticmethod
    def forward(ctx, x, group):
        source = key_source(x, group.tiles)
        ctx.group, ctx.shape, ctx.source_shape = group, x.shape, source.shape
        return group.key_tiles(source)

    @staticmethod
    def backward(ctx, grad_tiles):
        B, H, n, D = ctx.shape
        grad = grad_tiles.new_zeros(ctx.source_shape)
        ctx.group.accumulate_keys(grad, grad_tiles)
        return key_grad(grad, ctx.group.tiles, B, n), None


def key_source(x, tiles: ChunkTiles):
    """What _TileGroup.key_tiles reads for keys or values x (B, H, n, D): x itself for a band (each group of chunks
    pads and copies its own band right before the kernel reads it, while it is in cache: 15% faster on CPU than
    a whole chunked copy made first), else x with one zero row after the end (B * H, n + 1, D), which padded
    key slots read, gathered by index."""
    if tiles.band is not None:
        return x
    B, H, n, D = x.shape
    out = x.new_empty(B, H, n + 1, D)
    out[:, :, n].zero_()
    out[:, :, :n] = x
    return out.view(B * H, n + 1, D)


def key_grad_buffer(source, tiles: ChunkTiles, dtype=None):
    """Zeros shaped like key_source's result, which _TileGroup.accumulate_keys adds into."""
    return torch.zeros_like(source, dtype=dtype)


def key_grad(buffer, tiles: ChunkTiles, B: int, n: int):
    """The (B, H, n, D) gradient from key_grad_buffer's accumulated buffer."""
    if tiles.band is not None:
        return buffer
    BH, _, D = buffer.shape
    return buffer.view(B, BH // B, n + 1, D)[:, :, :n]


def _per_batch_head(mask, B):
    """A tile mask (nc, c, K) or per-head (H, nc, c, K) in the (B * H, nc, c, K) layout of the tiles."""
    return mask.expand(B, *mask.shape).flatten(0, 1) if mask.dim() == 4 else mask[None]


def candidate_key_blocks(rule: EdgeRule, n: int, size: int, start: int = 0) -> list[list[int]]:
    """For each query block of `size` positions (from position start), the key blocks inside the sequence where
    rule.key_ranges says its queries may have edges."""
    candidates, keys = [], rule.key_count(n)
    for i in range(-(-n // size)):
        q_lo, q_hi = start + i * size, start + min(n, (i + 1) * size)
        blocks = set()
        for lo, hi in rule.key_ranges(q_lo, q_hi):
            lo, hi = max(lo, start) - start, min(hi, start + keys) - start
            if lo < hi:
                blocks.update(range(lo // size, (hi - 1) // size + 1))
        candidates.append(sorted(blocks))
    return candidates


def _block_grid(rule: EdgeRule, n: int, start: int, size: int, key_blocks: torch.Tensor, n_head: int, device,
                valid: int | None = None, first: int = 0) -> torch.Tensor:
    """allowed() on every (query block, key block slot) tile: (nb, size, S * size), or per head (H, nb, size,
    S * size), for the query blocks first, first + 1, ... of `size` positions (from position start) and their
    slots key_blocks (nb, S), -1 for none. Keys outside the sequence (or at or past `valid`) are never allowed;
    positions are clamped into it before the rule sees them (rules may index tensors by position)."""
    nb, S = key_blocks.shape
    real = n if valid is None else valid
    q = (first + torch.arange(nb, device=device))[:, None] * size + torch.arange(size, device=device)  # (nb, size)
    offsets = torch.arange(size, device=device)
    k = (key_blocks.to(device)[:, :, None] * size + offsets).flatten(1)  # (nb, S size)
    keys = rule.key_count(real)
    inside = (key_blocks.to(device) >= 0).repeat_interleave(size, 1) & (k >= 0) & (k < keys)
    h = torch.arange(n_head, device=device)[:, None, None, None] if rule.per_head else None
    allowed = rule.allowed(q.clamp(max=real - 1)[:, :, None] + start, k.clamp(0, keys - 1)[:, None, :] + start, h)
    return allowed & inside[:, None, :]


def _used_keys(rule: EdgeRule, n: int, size: int, n_head: int, start: int = 0, valid: int | None = None):
    """Yields (first query block, their candidate key blocks (g, S), which candidate keys hold an allowed edge
    of some query of the block in any head (g, S size)) over the query blocks of `size` positions, a group of
    blocks at a time. Candidates come from rule.key_ranges (a rule whose ranges are every earlier key costs
    O(n^2) time here, once per length, never n x n memory)."""
    candidates = candidate_key_blocks(rule, n, size, start)
    widest = max(map(len, candidates), default=1) or 1
    heads = n_head if rule.per_head else 1
    per_group = max(1, (1 << 24) // (heads * size * widest * size))
    for first in range(0, len(candidates), per_group):
        group = candidates[first:first + per_group]
        slots = torch.full((len(group), widest), -1, dtype=torch.long)
        for i, blocks in enumerate(group):
            slots[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        grid = _block_grid(rule, n, start, size, slots, n_head, "cpu", valid, first)
        grid = grid.any(0) if rule.per_head else grid  # (g, size, widest size)
        rows = torch.arange(first, first + len(group))[:, None] * size + torch.arange(size)
        grid = grid & (rows < n)[:, :, None]  # padded query rows hold no edge
        yield first, slots, grid.any(1)


def _padded_rows(rows: list[list[int]], fill: int) -> torch.Tensor:
    width = max(map(len, rows), default=1) or 1
    out = torch.full((len(rows), width), fill, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def block_structure(rule: EdgeRule, n: int, size: int, n_head: int, device, start: int = 0,
                    valid: int | None = None) -> torch.Tensor:
    """(nb, S) key blocks per query block of `size` positions that hold at least one allowed edge (in any head),
    -1 for unused slots: FlexAttention's block masks and the chunked kernel's band, O(n S size) memory."""
    kept = []
    for _, slots, used in _used_keys(rule, n, size, n_head, start, valid):
        used = used.view(len(slots), -1, size).any(-1)  # (g, S)
        kept += [slots[i][used[i]].tolist() for i in range(len(slots))]
    return _padded_rows(kept, -1).to(device)


def edge_keys(rule: EdgeRule, n: int, size: int, n_head: int, start: int = 0) -> list[list[int]]:
    """For each query block of `size` positions, the sorted key positions (from start, inside the sequence)
    with an allowed edge of some query of the block in any head: the compacted tiles' keys."""
    keys = []
    for _, slots, used in _used_keys(rule, n, size, n_head, start):
        positions = (slots[:, :, None] * size + torch.arange(size)).flatten(1)
        keys += [positions[i][used[i]].tolist() for i in range(len(slots))]
    return keys


BAND_SLACK = 1.1  # a band whose tiles hold at most this much more than the compacted keys runs as a band


def _as_band(key_chunks: list[list[int]], nc: int, keys: int, chunk: int) -> tuple[torch.Tensor | None, int | None]:
    """The key chunks as a band when they fit one: every chunk i's key chunks inside i - back .. i + ahead,
    slot j holding chunk i - back + j (-1 outside the sequence), so that tiles are slices of the keys and
    relative position biases have the same tile for every chunk, while the band's keys stay within
    BAND_SLACK of the `keys` compacted tiles would hold (a dilated window's residue classes in their layout:
    the first chunks of a class have no edge in the band's earlier chunks). (None, None) otherwise."""
    back = max((i - row[0] for i, row in enumerate(key_chunks) if row), default=0)
    ahead = max((row[-1] - i for i, row in enumerate(key_chunks) if row), default=0)
    band = torch.arange(nc)[:, None] - back + torch.arange(back + 1 + ahead)
    band = torch.where((band >= 0) & (band < nc), band, -1)
    if int((band >= 0).sum()) * chunk > BAND_SLACK * max(keys, 1):
        return None, None
    return band, back


def _chunk_tiles(rule: EdgeRule, n: int, start: int, chunk: int, n_head: int, device) -> ChunkTiles:
    """The block-sparse kernel's tiles of a rule over n positions (uncached: rules drawn per forward use it
    directly). A static rule's are a band when its edges make one, else compacted; a rule drawn per forward
    (sa's permutation) keeps its lookback band without the check for empty blocks (it is planned at every
    forward)."""
    nc = -(-n // chunk)
    index, widths = None, ()
    if rule.static:
        keys = edge_keys(rule, n, chunk, n_head, start)
        chunks_of = [sorted({k // chunk for k in row}) for row in keys]
        key_chunks, band = _as_band(chunks_of, nc, sum(map(len, keys)), chunk)
        if band is None:
            widths = tuple(map(len, keys))
            index = _padded_rows(keys, n)
    else:
        band, ahead = -(-rule.lookback // chunk), -(-rule.lookahead // chunk)
        key_chunks = torch.arange(nc)[:, None] - band + torch.arange(band + 1 + ahead)
        key_chunks = torch.where((key_chunks >= 0) & (key_chunks < nc), key_chunks, -1)
    bounds = [(0, nc)] if index is None else width_segments(widths)
    if index is None:
        masks = [_block_grid(rule, n, start, chunk, key_chunks, n_head, device)]
    else:
        masks = [_key_grid(rule, n, start, chunk, index[first:end, :max(1, max(widths[first:end]))], n_head, device,
                           first) for first, end in bounds]
    if masks[0].dim() == 4 and all(bool((m == m[:1]).all()) for m in masks):  # per head, the same edges in each
        masks = [m[0] for m in masks]
    segments, has_key = [], []
    for (first, end), mask in zip(bounds, masks):
        # padded queries past the end attend to every key of their tile: their outputs are dropped, and a full
        # row keeps the fused kernels free of empty rows
        q_pos = torch.arange(first, end, device=device)[:, None] * chunk + torch.arange(chunk, device=device)
        mask = mask | (q_pos >= n)[:, :, None]
        segments.append((first, end, mask, ~(mask | ~mask.any(-1, keepdim=True))))
        has_key.append(mask.any(-1))
    has_key = torch.cat(has_key, -2)
    has_key = has_key.reshape(*has_key.shape[:-2], -1)[..., :n, None]  # (n, 1) or (H, n, 1)
    keep = None if bool(has_key.all()) else has_key.to(torch.float32)
    return ChunkTiles(tuple(segments), chunk, None if key_chunks is None else key_chunks.to(device), band, keep,
                      None if index is None else index.to(device), widths)


def width_segments(widths: tuple) -> list[tuple[int, int]]:
    """Runs [first, end) of chunks whose widths stay within WIDTH_SPREAD of each other: compacted tiles are
    stored and computed at their run's widest, never at the widest chunk of the sequence."""
    out, first, low, high = [], 0, None, None
    for i, width in enumerate(widths):
        width = max(1, width)
        if low is not None and max(high, width) > WIDTH_SPREAD * min(low, width):
            out.append((first, i))
            first, low, high = i, width, width
        else:
            low, high = (width, width) if low is None else (min(low, width), max(high, width))
    out.append((first, len(widths)))
    return out


def _key_grid(rule: EdgeRule, n: int, start: int, chunk: int, index: torch.Tensor, n_head: int, device,
              first: int = 0):
    """allowed() of query chunks first, first + 1, ... against their compacted keys index (g, K), n for padding:
    (g, c, K), or per head (H, g, c, K)."""
    nc = index.shape[0]
    q = torch.arange(first, first + nc, device=device)[:, None] * chunk + torch.arange(chunk, device=device)
    k = index.to(device)
    h = torch.arange(n_head, device=device)[:, None, None, None] if rule.per_head else None
    last = n - 1
    allowed = rule.allowed(q.clamp(max=last)[:, :, None] + start, k.clamp(max=last)[:, None, :] + start, h)
    return allowed & (k < n)[:, None, :]


_cached_chunk_tiles = functools.lru_cache(maxsize=64)(_chunk_tiles)


def chunked_attention(q, k, v, rule: EdgeRule, start: int = 0, chunk: int = 128, score_mod=None,
                      activation="softmax", dropout_p: float = 0.0, fused: bool = True, tiles: ChunkTiles = None,
                      cpu_flash: bool | None = None):
    """Block-sparse attention, O(edges): query chunks of `chunk` positions, each over the key chunks that hold
    its allowed edges (tiles: the rule's ChunkTiles at this length, from plan_attention; built here when not
    given).

    Without dropout and with no score_mod or a ScoreBias, softmax on CPU runs ChunkedFlashCPU (groups of tiles
    through PyTorch's fused CPU flash kernel, forward and backward) and sigmoid runs ChunkedSigmoid on any
    device; other cases build all tiles at once and use autograd (`fused=False` forces that path, for tests).
    cpu_flash=False (the plan's choice on the CPU standing in for CUDA) takes CUDA's branch on the CPU.
    """
    B, H, n, D = q.shape
    if tiles is None:
        tiles_of = _cached_chunk_tiles if rule.static else _chunk_tiles
        tiles = tiles_of(rule, n, start, chunk or rule.chunk_size(), H, str(q.device))
    c = tiles.chunk
    plain = score_mod is None and activation == "softmax"
    if fused and _fusable(score_mod) and dropout_p == 0.0:
        if cpu_flash is None:  # not planned: CUDA's branch on CUDA and on the CPU standing in for it
            cpu_flash = not simulate_cuda.gpu_path(q.device)
        if activation == "softmax" and q.device.type == "cpu" and cpu_flash:
            return ChunkedFlashCPU.apply(q, k, v, ((0, H, tiles, None),), score_mod, start)
        if activation == "sigmoid":
            return ChunkedSigmoid.apply(q, k, v, tiles, score_mod, start)

    parts = []
    for first, end, mask, _ in tiles.segments:  # each segment's chunks at once: (B * H, s, c or S c, D) tiles
        group = _TileGroup(first, end, n, tiles)
        q_tiles, k_tiles, v_tiles = group.query_tiles(q), KeyTiles.apply(k, group), KeyTiles.apply(v, group)
        if plain:  # one batched fused SDPA over the segment's tiles
            y = _fused_softmax(q_tiles, k_tiles, v_tiles, _per_batch_head(mask, B), dropout_p)
        else:
            q_pos, k_pos = group.positions(start, q.device)
            y = masked_attention(*(t.view(B, H, *t.shape[1:]) for t in (q_tiles, k_tiles, v_tiles)), mask, q_pos,
                                 k_pos, score_mod, activation, dropout_p, fused=False)
        parts.append(y.reshape(B, H, (end - first) * c, D))
    return (parts[0] if len(parts) == 1 else torch.cat(parts, 2))[:, :, :n]


class ChunkedFlashCPU(torch.autograd.Function):
    """Block-sparse softmax attention through the fused CPU flash kernel, a fixed number of query positions per
    call in forward and backward.

    plans: one (first head, end head, ChunkTiles) per group of heads
    (one group for a plain rule; one per window for multi-scale windows), each written straight into the
    shared output and gradients. Only the inputs, output and gradients are full-size (and each one's chunked
    copy, made once per call); tiles, masks and padding are built per group of chunks, so large temporaries
    are neither allocated nor page-faulted at every call, and time stays linear in the edges (one call over all
    tiles grew ~2.5x from n=8K to 16K on a 2-core CPU; see docs/benchmarks.md).
    """

    @staticmethod
    def forward(ctx, q, k, v, plans, score_bias=None, start=0):
        B, _, n, _ = q.shape
        out = torch.empty_like(q)
        lses, chunked = [], []
        for h0, h1, tiles, layout in plans:
            c, nc = tiles.chunk, tiles.n_chunks
            q_h, out_h = q[:, h0:h1], out[:, h0:h1]
            k_chunks, v_chunks = key_source(k[:, h0:h1], tiles), key_source(v[:, h0:h1], tiles)
            chunked += [k_chunks, v_chunks]  # kept for backward (instead of k and v: no more memory, no new copy)
            lse = q.new_empty(B * (h1 - h0), nc, c, dtype=torch.promote_types(q.dtype, torch.float32))
            for g in ChunkedFlashCPU._groups(n, tiles, B * (h1 - h0), layout):
                y, lse[:, g.i0:g.i1] = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    g.query_tiles(q_h), g.key_tiles(k_chunks), g.key_tiles(v_chunks), 0.0, False,
                    attn_mask=g.bias(q.dtype, B, score_bias, range(h0, h1), start))
                g.scatter_queries(out_h, y)
            if tiles.keep is not None:  # rows without a key attended everywhere inside the kernel: zero them
                out_h.mul_(_in_token_order(tiles.keep, layout).to(out_h.dtype))
            lses.append(lse)
        ctx.plans, ctx.score_bias, ctx.start, ctx.k_shape = plans, score_bias, start, k.shape
        ctx.save_for_backward(q, out, *lses, *chunked)
        return out

    @staticmethod
    def backward(ctx, grad_y):
        q, out, *saved = ctx.saved_tensors
        lses, chunked = saved[:len(ctx.plans)], saved[len(ctx.plans):]
        B, _, n, D = q.shape
        grad_q, grad_k, grad_v = torch.empty_like(q), [], []
        for i, ((h0, h1, tiles, layout), lse) in enumerate(zip(ctx.plans, lses)):
            q_h, out_h, grad_y_h = (t[:, h0:h1] for t in (q, out, grad_y))
            k_chunks, v_chunks = chunked[2 * i], chunked[2 * i + 1]
            grad_k_chunks, grad_v_chunks = key_grad_buffer(k_chunks, tiles), key_grad_buffer(v_chunks, tiles)
            if tiles.keep is not None:
                grad_y_h = grad_y_h * _in_token_order(tiles.keep, layout).to(grad_y_h.dtype)
            for g in ChunkedFlashCPU._groups(n, tiles, B * (h1 - h0), layout):
                g_q, g_k, g_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    g.query_tiles(grad_y_h), g.query_tiles(q_h), g.key_tiles(k_chunks), g.key_tiles(v_chunks),
                    g.query_tiles(out_h), lse[:, g.i0:g.i1].contiguous(), 0.0, False,
                    attn_mask=g.bias(q.dtype, B, ctx.score_bias, range(h0, h1), ctx.start))
                g.scatter_queries(grad_q[:, h0:h1], g_q)
                g.accumulate_keys(grad_k_chunks, g_k)
                g.accumulate_keys(grad_v_chunks, g_v)
            grad_k.append(key_grad(grad_k_chunks, tiles, B, n))  # no copy for a single group of heads
            grad_v.append(key_grad(grad_v_chunks, tiles, B, n))
        join = (lambda parts: parts[0]) if len(grad_k) == 1 else (lambda parts: torch.cat(parts, dim=1))  # noqa: E731
        return grad_q, join(grad_k), join(grad_v), None, None, None

    @staticmethod
    def _groups(n, tiles, batch_heads, layout=None):
        """Calls of at most TILE_ROWS_PER_CALL rows, inside one segment of the tiles (chunks of similar widths:
        a call's compacted tiles are as wide as its widest chunk)."""
        c = tiles.chunk
        per_call = max(1, TILE_ROWS_PER_CALL // (batch_heads * c))  # narrow head groups take more chunks
        for first, end, _, _ in tiles.segments:
            for i0 in range(first, end, per_call):
                yield _TileGroup(i0, min(end, i0 + per_call), n, tiles, layout)


def _in_token_order(keep, layout):
    """A per-row factor (n, 1) or (H, n, 1) over layout rows, in the tokens' order."""
    return keep if layout is None else keep.index_select(-2, layout.slot_of.to(keep.device) + layout.halo)


class ChunkedSigmoid(torch.autograd.Function):
    """Block-sparse sigmoid attention y_i = sum_j sigmoid(s_ij) v_j over the rule's edges (s = q.k / sqrt(d)
    plus an optional ScoreBias), in groups of chunks as ChunkedFlashCPU, on any device.

    Forward keeps each group's probabilities p = sigmoid(s) for backward when gradients are needed (O(edges)
    memory, as autograd over the tiles; recomputing them cost a sixth more time on CPU). dv = p^T dy,
    ds = (dy v^T) p (1 - p), dq = ds k / sqrt(d), dk = ds^T q / sqrt(d). Scores are in float32 (float64 for
    float64 inputs); disallowed scores are -inf, so their p and ds are exactly zero.
    """

    @staticmethod
    def forward(ctx, q, k, v, tiles, score_bias=None, start=0):
        B, H, n, D = q.shape
        out = torch.empty_like(q)
        kept, keep = [], any(ctx.needs_input_grad[:3])  # no gradients needed (evaluation): keep nothing
        k_chunks, v_chunks = key_source(k, tiles), key_source(v, tiles)
        with torch.autocast(q.device.type, enabled=False):  # scores in float32 even inside an autocast region
            for g in ChunkedFlashCPU._groups(n, tiles, B * H):
                probs = ChunkedSigmoid._probs(g, q, k_chunks, score_bias, start)
                y = probs @ ChunkedSigmoid._tiles(g.key_tiles(v_chunks), B, probs.dtype)
                g.scatter_queries(out, y.flatten(0, 1).to(q.dtype))
                if keep:
                    kept.append(probs)
        ctx.tiles = tiles
        ctx.save_for_backward(q, k, v, *kept)
        return out

    @staticmethod
    def backward(ctx, grad_y):
        q, k, v, *kept = ctx.saved_tensors
        tiles = ctx.tiles
        B, H, n, D = q.shape
        compute = torch.promote_types(q.dtype, torch.float32)
        # key and value gradients sum over tile slots and groups: accumulated in the compute dtype
        grad_q = torch.empty_like(q)
        k_chunks, v_chunks = key_source(k, tiles), key_source(v, tiles)
        grad_k, grad_v = key_grad_buffer(k_chunks, tiles, compute), key_grad_buffer(v_chunks, tiles, compute)
        scale = 1 / math.sqrt(D)
        groups = ChunkedFlashCPU._groups(n, tiles, B * H)
        with torch.autocast(q.device.type, enabled=False):
            for g, probs in zip(groups, kept):
                dy = ChunkedSigmoid._tiles(g.query_tiles(grad_y), B, compute)
                q_t = ChunkedSigmoid._tiles(g.query_tiles(q), B, compute)
                k_t = ChunkedSigmoid._tiles(g.key_tiles(k_chunks), B, compute)
                v_t = ChunkedSigmoid._tiles(g.key_tiles(v_chunks), B, compute)
                d_scores = torch.ops.aten.sigmoid_backward(dy @ v_t.transpose(-1, -2), probs)  # dp * p * (1 - p)
                g.scatter_queries(grad_q, (d_scores @ k_t * scale).flatten(0, 1).to(q.dtype))
                g.accumulate_keys(grad_k, (d_scores.transpose(-1, -2) @ q_t * scale).flatten(0, 1))
                g.accumulate_keys(grad_v, (probs.transpose(-1, -2) @ dy).flatten(0, 1))
        return (grad_q, key_grad(grad_k, tiles, B, n).to(k.dtype), key_grad(grad_v, tiles, B, n).to(v.dtype), None,
                None, None)

    @staticmethod
    def _tiles(tiles, B, dtype):
        """(B * H, g, rows, D) tiles as (B, H, g, rows, D) in the compute dtype."""
        return tiles.view(B, -1, *tiles.shape[1:]).to(dtype)

    @staticmethod
    def _probs(g, q, k_chunks, score_bias, start):
        B, H, n, D = q.shape
        compute = torch.promote_types(q.dtype, torch.float32)
        q_t = ChunkedSigmoid._tiles(g.query_tiles(q), B, compute)
        k_t = ChunkedSigmoid._tiles(g.key_tiles(k_chunks), B, compute)
        scores = (q_t * (1 / math.sqrt(D))) @ k_t.transpose(-1, -2)  # (B, H, chunks, c, S c)
        if score_bias is not None:
            scores.add_(g.score_bias(score_bias, range(H), start, q.device))
        return scores.masked_fill_(~g.tile_mask(), float("-inf")).sigmoid_()


class _TileGroup:
    """Chunks i0..i1 of a block-sparse attention call: their query rows, padded locally, and their keys: for a
    band (slot j of chunk i is chunk i - band + j) shifted slices of the group's keys, padded locally; for
    compacted tiles a gather by index from key_source's layout, as wide as the group's widest chunk (padded
    slots read its zero row)."""

    def __init__(self, i0, i1, n, tiles: ChunkTiles, layout: Layout | None = None):
        self.i0, self.i1, self.n, self.c, self.tiles = i0, i1, n, tiles.chunk, tiles
        self.n_chunks, self.band = tiles.n_chunks, tiles.band
        self.q_lo, self.q_hi = i0 * self.c, min(n, i1 * self.c)
        # tiles over a layout's rows read and write the tokens' tensors through its gather index (a permutation:
        # no halo), instead of whole copies of q, k, v and the output in layout order
        token = None if layout is None else layout.token.to(tiles.device)
        self.layout = layout
        self.q_rows = self._layout_rows(token, self.q_lo, self.q_hi)
        if self.band is None:
            self.width = max(tiles.widths[i0:i1]) or 1
            self.keys = tiles.key_index[i0:i1, :self.width]  # (g, width) rows, n: padding
            self.index = self.keys.flatten()
            if token is not None:
                self.index = torch.cat([token, token.new_full((1,), n)])[self.index]
        else:  # the group's band of key positions, possibly reaching outside the sequence, padded locally
            self.slots = tiles.slots
            self.width = self.slots * self.c
            self.key_chunks = tiles.key_chunks[i0:i1]  # (g, S), -1: outside the sequence
            first, last = (i0 - self.band) * self.c, (i1 - self.band + self.slots - 1) * self.c
            self.k_lo, self.k_hi = max(0, first), min(n, last)
            self.k_pad = (self.k_lo - first, last - self.k_hi)
            self.k_rows = self._layout_rows(token, self.k_lo, self.k_hi)

    def _layout_rows(self, token, lo, hi):
        """How rows lo..hi of the layout are read: None (no layout: a slice), strided pieces (a residue class's
        run: views), or the gather index."""
        if token is None:
            return None
        pieces = self.layout.pieces(lo, hi)
        return pieces if pieces is not None else token[lo:hi]

    @staticmethod
    def _padded_rows(x, lo, hi, rows, before, after):
        """x's layout rows lo..hi along dim 2 (a slice, strided views, or a gather through the layout), with
        `before` and `after` zero rows around them: one copy."""
        if rows is None:
            return F.pad(x[:, :, lo:hi], (0, 0, before, after))
        B, H, _, D = x.shape
        out = x.new_empty(B, H, before + (hi - lo) + after, D)
        out[:, :, :before].zero_()
        out[:, :, before + hi - lo:].zero_()
        if isinstance(rows, list):
            first = before
            for start, stop, step, count in rows:
                out[:, :, first:first + count] = x[:, :, start:stop:step]
                first += count
        else:
            out[:, :, before:before + hi - lo] = x.index_select(2, rows)
        return out

    def tile_mask(self, closed: bool = False):
        """The group's part of its tiles' mask (or closed pairs): (..., g, c, width)."""
        return self.tiles.tile_mask(self.i0, self.i1, self.width, closed)

    def query_tiles(self, x):
        B, H, _, D = x.shape
        part = self._padded_rows(x, self.q_lo, self.q_hi, self.q_rows, 0,
                                 (self.i1 - self.i0) * self.c - (self.q_hi - self.q_lo))
        return part.reshape(B * H, self.i1 - self.i0, self.c, D)

    def key_tiles(self, source):
        """key_source's result -> (B * H, g, width, D): every chunk's keys side by side. A band: the group's key
        positions padded locally, each slot a shifted slice; compacted tiles: a gather by index."""
        g, c = self.i1 - self.i0, self.c
        if self.band is not None:
            B, H, _, D = source.shape
            part = self._padded_rows(source, self.k_lo, self.k_hi, self.k_rows, *self.k_pad).reshape(B * H, -1, c, D)
            return torch.cat([part[:, j:j + g] for j in range(self.slots)], dim=2)
        BH, _, D = source.shape
        return source.index_select(1, self.index).view(BH, g, self.width, D)

    def accumulate_keys(self, grad, tile_grads):
        """Add the gradients of every tile slot back onto the keys they came from, in key_grad_buffer's layout
        (padded slots onto the zero row, which is dropped)."""
        g, c = self.i1 - self.i0, self.c
        if self.band is not None:
            B, H, _, D = grad.shape
            local = tile_grads.new_zeros(B * H, g + self.slots - 1, c, D, dtype=grad.dtype)
            for j in range(self.slots):  # slot j of chunk i holds band chunk i - i0 + j
                local[:, j:j + g] += tile_grads[:, :, j * c:(j + 1) * c]
            local = local.reshape(B, H, -1, D)
            local = local[:, :, self.k_pad[0]:local.shape[2] - self.k_pad[1]]
            if self.k_rows is None:
                grad[:, :, self.k_lo:self.k_hi] += local
            elif isinstance(self.k_rows, list):
                write_rows(grad, self.k_rows, local, add=True)
            else:
                grad.index_add_(2, self.k_rows, local)
            return
        BH, _, D = grad.shape
        grad.index_add_(1, self.index, tile_grads.reshape(BH, g * self.width, D).to(grad.dtype))

    def bias(self, dtype, B, score_bias=None, heads=None, start=0, open_empty_rows=True):
        """Additive mask of the group: -inf outside the rule's edges, plus score_bias (a ScoreBias) of the given
        heads inside them. For the fused softmax kernel, rows without any allowed key are opened everywhere
        (their outputs are zeroed by the caller). B: laid out as (B * H, ...) tiles; None: (H or 1, ...)."""
        closed = self.tile_mask(closed=True) if open_empty_rows else ~self.tile_mask()
        device = closed.device
        if score_bias is None:  # one pass
            bias = torch.where(closed, torch.tensor(float("-inf"), dtype=dtype, device=device),
                               torch.tensor(0.0, dtype=dtype, device=device))
        else:
            bias = self.score_bias(score_bias, heads, start, device).to(dtype).expand(-1, closed.shape[-3], -1, -1)
            bias = bias.masked_fill(closed, float("-inf"))
        return bias if B is None else _per_batch_head(bias, B)

    def score_bias(self, score_bias, heads, start, device):
        """A ScoreBias over the group's tiles for the given heads: (H, chunks, c, S c), or (H, 1, c, S c) when it
        depends on q - k only (`relative`) and every chunk's slots are its band, so every tile has the same
        offsets."""
        h = torch.arange(heads.start, heads.stop, device=device)[:, None, None, None]  # a range: no host copy
        if score_bias.relative and self.band is not None:
            q_pos = self.band * self.c + torch.arange(self.c, device=device)
            k_pos = torch.arange(self.slots * self.c, device=device)
            return score_bias.bias(h, q_pos[None, :, None], k_pos[None, None, :])
        q_pos, k_pos = self.positions(start, device)
        return score_bias.bias(h, q_pos[:, :, None], k_pos[:, None, :])

    def positions(self, start, device):
        """Absolute positions of the group's query rows (chunks, c) and tile keys (chunks, width); padded slots
        get positions past the end, which no rule's mask allows here."""
        first = start + self.c * torch.arange(self.i0, self.i1, device=device)[:, None]
        if self.band is None:
            keys = self.keys.to(device)
        else:
            chunks = torch.where(self.key_chunks >= 0, self.key_chunks, self.n_chunks).to(device)
            keys = (chunks[:, :, None] * self.c + torch.arange(self.c, device=device)).flatten(1)
        return first + torch.arange(self.c, device=device), start + keys

    def scatter_queries(self, full, tiles):
        B, H, _, D = full.shape
        rows = tiles.reshape(B, H, -1, D)[:, :, :self.q_hi - self.q_lo]
        if self.q_rows is None:
            full[:, :, self.q_lo:self.q_hi] = rows
        elif isinstance(self.q_rows, list):
            write_rows(full, self.q_rows, rows)
        else:
            full.index_copy_(2, self.q_rows, rows)


# ---- FlexAttention ---------------------------------------------------------------------------------------

FLEX_BLOCK = 128  # FlexAttention's default block size
# eager calls (evaluation, generation's prefill) go through one compiled flex_attention; lengths are padded up
# to these buckets (multiples of FLEX_BLOCK, two per octave) so that a grid of lengths or the varying widths
# of ranking batches compile a bounded number of kernels
FLEX_RECOMPILE_LIMIT = 64  # distinct (rule, bucket, batch, dtype) kernels before it fails (never a silent fallback)
# None: on CUDA (and on the CPU standing in for it, compiled with aot_eager); eager on the CPU otherwise, where
# flex checks masks in the tests, forward only
COMPILE_EAGER_FLEX = None


def flex_length_bucket(n: int) -> int:
    """The padded length of an eager flex call: the smallest of 128, 256, 384, 512, 768, 1024, 1536, ... >= n
    (powers of two and, from 384 on, 3/4 of them: at most a third of a call is padding)."""
    size = FLEX_BLOCK
    while size < n:
        size *= 2
    return size * 3 // 4 if size >= 4 * FLEX_BLOCK and n <= size * 3 // 4 else size


def flex_block_mask(rule: EdgeRule, n: int, n_head: int | None, device: str, start: int = 0, valid: int | None = None):
    """The block mask of a rule at one length. A static rule's is built once and shared by every layer using
    it; a per-forward rule (a permutation) gets the block structure of its band, which depends only on the
    length and the band, with the rule's mask_mod evaluated inside every block of it. valid < n: positions
    valid.. are padding (no key there is allowed; see flex)."""
    if rule.static:
        return _static_block_mask(rule, n, n_head, device, start, valid)
    if rule.lookback is None:
        raise ValueError(f"{type(rule).__name__} is drawn per forward and unbounded: flex needs a banded layout")
    if valid is not None:
        raise ValueError("a rule drawn per forward is not padded: plan it at its own length")
    from torch.nn.attention.flex_attention import BlockMask

    kv_num_blocks, kv_indices = _band_blocks(n, rule.lookback, rule.lookahead, device)
    return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=_shifted_mask_mod(rule, start), seq_lengths=(n, n))


def _shifted_mask_mod(rule, start):
    mask_mod = rule.mask_mod()
    return mask_mod if start == 0 else (lambda b, h, q_idx, kv_idx: mask_mod(b, h, q_idx + start, kv_idx + start))


def _padded_mask_mod(mask_mod, valid: torch.Tensor):
    """mask_mod over the first `valid` positions of a padded sequence: no key at or past valid, and positions
    clamped into the sequence before the rule sees them (rules may index tensors by position). valid is a
    0-d tensor, not a python int, so compiled flex treats every length alike instead of recompiling for each."""
    def padded(b, h, q_idx, kv_idx):
        last = valid - 1
        return (kv_idx < valid) & mask_mod(b, h, torch.minimum(q_idx, last), torch.minimum(kv_idx, last))
    return padded


@functools.lru_cache(maxsize=64)
def _static_block_mask(rule, n, n_head, device, start, valid=None):
    """The block mask from the rule's block structure (block_structure: each query block's key blocks that hold
    an allowed edge, found from rule.key_ranges), each block marked full or partial from allowed() over its
    tile: O(edges) memory, never the n x n mask that eager create_block_mask materialises (~11 bytes per
    element: 716 MiB at n = 8192)."""
    from torch.nn.attention.flex_attention import BlockMask

    size = FLEX_BLOCK
    n_blocks, kv_blocks = -(-n // size), -(-rule.key_count(n) // size)
    key_blocks = block_structure(rule, n, size, n_head or 1, "cpu", start, valid)  # (nb, S), -1: none
    heads = n_head if rule.per_head else 1
    per_group = max(1, (1 << 24) // (heads * size * key_blocks.shape[1] * size))
    partial, full = [], []
    for first in range(0, n_blocks, per_group):
        slots = key_blocks[first:first + per_group]
        grid = _block_grid(rule, n, start, size, slots, n_head or 1, "cpu", valid, first)
        rows = (first + torch.arange(len(slots)))[:, None] * size + torch.arange(size)
        grid = grid & (rows < n)[:, :, None]  # entries past the length count as not allowed, as create_block_mask's
        grid = grid.expand(heads, *grid.shape[-3:]).reshape(heads, len(slots), size, slots.shape[1], size)
        present = (slots >= 0)[None]
        partial.append(grid.any(-1).any(-2) & ~grid.all(-1).all(-2) & present)
        full.append(grid.all(-1).all(-2) & present)

    def as_kv_blocks(present):  # (heads, nb, S) -> counts (1, heads, nb), indices (1, heads, nb, kv blocks)
        index = key_blocks.expand_as(present)
        order = torch.where(present, index, 3 * kv_blocks + index).argsort(dim=-1, stable=True)  # present first
        indices = index.gather(-1, order).clamp(0, kv_blocks - 1)
        pad = indices.new_zeros(*indices.shape[:-1], max(0, kv_blocks - indices.shape[-1]))
        indices = torch.cat([indices, pad], -1)[..., :kv_blocks]
        to = lambda t: t.to(device=device, dtype=torch.int32)[None].contiguous()  # noqa: E731
        return to(present.sum(-1)), to(indices)

    kv_num, kv_idx = as_kv_blocks(torch.cat(partial, 1))
    full_num, full_idx = as_kv_blocks(torch.cat(full, 1))
    mask_mod = _shifted_mask_mod(rule, start)
    if valid is not None:
        mask_mod = _padded_mask_mod(mask_mod, torch.tensor(valid, device=device))
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=size, mask_mod=mask_mod,
                                    seq_lengths=(n, rule.key_count(n)))


@functools.lru_cache(maxsize=64)
def _band_blocks(n: int, lookback: int, lookahead: int, device: str):
    """kv_num_blocks and kv_indices (1, 1, query blocks, kv blocks) of the band -lookback <= k - q <=
    lookahead: every block it touches is partial (its mask_mod decides inside). Entries past a row's count
    are padding, as in create_block_mask's output."""
    n_blocks = -(-n // FLEX_BLOCK)
    first_query = torch.arange(n_blocks) * FLEX_BLOCK
    lo = (first_query - lookback).clamp(min=0) // FLEX_BLOCK
    hi = (first_query + FLEX_BLOCK - 1 + lookahead).clamp(max=n - 1) // FLEX_BLOCK
    count = hi - lo + 1
    indices = (lo[:, None] + torch.arange(n_blocks)).clamp(max=n_blocks - 1)
    as_mask = lambda t: t.to(device=device, dtype=torch.int32)[None, None].contiguous()
    return as_mask(count), as_mask(indices)


@functools.cache
def _compiled_flex(backend: str = "inductor"):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False, backend=backend)


def flex(q, k, v, rule: EdgeRule, start: int = 0, score_mod=None, activation="softmax", dropout_p: float = 0.0,
         block_mask=None):
    """FlexAttention under the rule's block mask. Sigmoid attention is computed by the softmax kernel: with
    scores replaced by log sigmoid(s), softmax gives sigmoid(s_j) / sum_k sigmoid(s_k), and the row's
    log-sum-exp is log sum_k sigmoid(s_k), so out * exp(lse) = sum_j sigmoid(s_j) v_j (rows without keys: 0).

    Inside a compiled block (training) flex_attention joins the block's graph, with the block mask and the
    score_mod planned outside it (plan_attention: score_mod already in flex's form). Called eagerly, it runs
    one compiled flex_attention, with the sequence padded to flex_length_bucket, and fails loudly rather than
    falling back to eager flex (which materialises (B, H, n, n) scores) if the kernels it compiled exceed
    FLEX_RECOMPILE_LIMIT."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    if activation not in ("softmax", "sigmoid"):
        raise ValueError(f"unknown attention activation {activation!r}: expected softmax or sigmoid")
    if dropout_p > 0:
        raise ValueError("the flex backend has no attention dropout: set dropout=0 or use attn_backend=chunked")
    on_cuda = simulate_cuda.gpu_path(q.device)  # CUDA, or the CPU standing in for it
    if on_cuda and q.shape[-1] < FLEX_MIN_HEAD_DIM:
        raise ValueError(f"FlexAttention on CUDA needs a head dimension of at least {FLEX_MIN_HEAD_DIM} (got "
                         f"{q.shape[-1]}): use attn_backend=chunked, or fewer, wider heads")
    if not on_cuda and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError("FlexAttention has no CPU backward in this torch version: train on CPU with "
                           "attn_backend=chunked (or auto)")
    if simulate_cuda.simulated(q.device) and not torch.compiler.is_compiling():
        simulate_cuda.allow_flex_cpu_backward()
    kwargs = {"enable_gqa": k.shape[1] != q.shape[1]}  # grouped-query: k, v heads shared, not repeated
    if activation == "sigmoid":
        kwargs["return_aux"] = AuxRequest(lse=True)
    finish = (lambda out: out) if activation == "softmax" else (lambda out: _sigmoid_output(*out, q.dtype))
    if torch.compiler.is_compiling():
        if block_mask is None:
            _refuse_while_compiling("the flex block mask")
        return finish(flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, **kwargs))
    if block_mask is None:  # not planned (a direct call): the score_mod in flex's form, as plan_attention makes it
        score_mod = _flex_score_mod(score_mod, start, activation)
    n, H, device = q.shape[2], q.shape[1], str(q.device)
    if not (on_cuda if COMPILE_EAGER_FLEX is None else COMPILE_EAGER_FLEX):  # eager flex: CPU mask checks
        block_mask = block_mask if block_mask is not None else flex_block_mask(rule, n, H, device, start)
        return finish(flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, **kwargs))
    # a permutation's band, and keys with a prefix of copies, are planned at their own length
    padded = flex_length_bucket(n) if rule.static and rule.key_count(n) == n else n
    if padded != n:
        block_mask = flex_block_mask(rule, padded, H, device, start, valid=n)
        q, k, v = (F.pad(t, (0, 0, 0, padded - n)) for t in (q, k, v))
    elif block_mask is None:
        block_mask = flex_block_mask(rule, n, H, device, start)
    # the default stance even where the caller runs eagerly (train.py's probes run under force_eager so that the
    # compiled blocks do not recompile for every probe length): force_eager would run flex_attention eagerly too,
    # materialising (B, H, n, n) scores
    with torch._dynamo.config.patch(recompile_limit=FLEX_RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True), \
            torch.compiler.set_stance("default"):
        try:
            out = _compiled_flex(simulate_cuda.compile_backend(q.device))(q, k, v, score_mod=score_mod,
                                                                           block_mask=block_mask, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            raise RuntimeError(f"compiled FlexAttention has built {FLEX_RECOMPILE_LIMIT} kernels (one per rule, padded "
                               "length, batch size and dtype) and would now fall back to materialising (B, H, n, n) "
                               "scores: evaluate fewer lengths, batch sizes or windows per process, or raise "
                               "attention.kernels.FLEX_RECOMPILE_LIMIT") from None
    return finish(out)[:, :, :n]


def _sigmoid_output(out, aux, dtype):
    return (out.float() * aux.lse.float().exp()[..., None]).to(dtype)


@functools.lru_cache(maxsize=64)
def _flex_score_mod(score_mod, start, activation):
    """The score_mod handed to FlexAttention, one object per (score_mod, start, activation): compiled flex
    recompiles for a new function object."""
    mod = score_mod
    if mod is not None and start:
        mod = lambda s, b, h, qi, ki: score_mod(s, b, h, qi + start, ki + start)
    if activation == "sigmoid":
        inner = mod
        mod = lambda s, b, h, qi, ki: _log_sigmoid(s if inner is None else inner(s, b, h, qi, ki))
    return mod


def _log_sigmoid(x):
    """log(sigmoid(x)) from pointwise ops. Not F.logsigmoid: its op (log_sigmoid_forward) returns an empty buffer
    on CUDA, which FlexAttention's eager form (vmap over the score_mod: aot_eager, uncompiled calls) cannot
    batch ("SmallVector unable to grow" on an H200, torch 2.11)."""
    return x.clamp(max=0) - torch.log1p(torch.exp(-x.abs()))
