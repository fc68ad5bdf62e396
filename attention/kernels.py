"""Which kernel runs attention under an edge rule (attention/edges.py), and its plan: the planner and dispatcher
over the kernels of attention/ops, and the scores each plan computes (computed_scores, layer_scores).

    dense    attention/ops/dense.py, the reference: explicit (B, H, Tq, Tk) scores in float32 or better, any
             device, O(n^2)
    chunked  attention/ops/chunked: block-sparse, O(edges) time and memory with autograd on any device (the CPU
             training path): queries in chunks of c, each attending to the keys that hold its allowed edges
             (ChunkTiles, from a scan of the rule's edges over its key_ranges: attention/ops/blocks.py): a sliding
             window's band of key chunks, else the chunk's keys compacted (own block, summary columns, sinks,
             global tokens), gathered by index. Plain softmax on CPU runs groups of tiles through
             PyTorch's fused CPU flash kernel, forward and backward (ChunkedFlashCPU), sigmoid attention runs
             ChunkedSigmoid on any device (both take a ScoreBias); elsewhere all tiles go through one batched
             SDPA call, or explicit math for other score_mods
    windows  attention/ops/window.py, chosen by the other backends for rules made of disjoint windows
             (EdgeRule.window_tiles: paper 004's bridge path): one batched SDPA call over one tile per window,
             its rows by its keys
    span     (CUDA, the default there for rules whose edges are spans) attention/ops/span: Triton kernels in which
             every query row attends one contiguous run of keys per head (sliding windows, multi-scale windows,
             blocks, the bridges' windows and their union with the blocks, stochastic attention's band in slot
             order), softmax or sigmoid, with ALiBi computed in the kernel: a tile costs its rows' spans
    flex     attention/ops/flex: FlexAttention with a block mask built once per (rule, length) from the same block
             structure and shared by all layers; compiled on CUDA; forward-only on CPU (torch 2.13 has no CPU
             backward for it), except on the CPU standing in for CUDA (attention/simulate_cuda.py: compiled with
             aot_eager, whose reference implementation runs forward and backward)
    sdpa     PyTorch's fused SDPA: is_causal for the causal rule, else a dense boolean mask (O(n^2) memory)

auto picks sdpa for plain causal attention only; on CUDA (and on the CPU standing in for it) span for every rule
whose edges are spans, with no score_mod or an ALiBi one, when Triton is installed, else flex; chunked elsewhere.
The GPU choice is GPU_CHOICES, with the measurements behind it (device, torch and Triton versions) beside it.

Layouts (attention/layouts.py): heads whose allowed offsets all share a divisor d > 1 (dilated, strided rules)
run each residue class mod d as a sequence of its own, found from the rule (or its residue_classes); the
chunked kernel reads such a layout's rows as strided views, FlexAttention runs on the rows gathered. Keys a
query block attends only sparsely (a summary column) are read by FlexAttention from a prefix of copies
(key_prefix). A rule with a score_mod, or a call from a position offset, keeps the tokens' order.

Every kernel takes the same optional `score_mod(score, b, h, q_idx, kv_idx)` (FlexAttention's signature, over
absolute positions, so one definition serves all backends: attention/ops/score_mod.py) and `activation`
("softmax" or "sigmoid": no normalisation), for variants that add position biases or change the score
nonlinearity. A score_mod that is a `ScoreBias` (an additive bias from head and positions only, such as ALiBi)
stays on the fused paths: the CPU flash kernel takes it in its additive mask, and sigmoid attention runs
ChunkedSigmoid (groups of chunks, a hand-written backward) on the chunked backend and FlexAttention's softmax of
log-sigmoid scores rescaled by exp(lse) on flex.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from attention import simulate_cuda
from attention.edges import Causal, EdgeRule
from attention.layouts import KeyPrefixRule, Layout, from_layout, layout_groups, to_layout
from attention.ops.blocks import _refuse_while_compiling
from attention.ops.chunked.op import ChunkedFlashCPU, _fusable, chunked_attention
from attention.ops.chunked.tiles import _cached_chunk_tiles, _chunk_tiles
from attention.ops.dense import _fused_softmax, _sdpa, dense_attention, repeat_kv
from attention.ops.flex.block_mask import FLEX_BLOCK, flex_block_mask, key_prefix
from attention.ops.flex.op import FLEX_MIN_HEAD_DIM, _flex_score_mod, flex
from attention.ops.score_mod import ScoreBias
from attention.ops.span.op import span_attention, span_blocks, triton_installed
from attention.ops.span.spans import Spans, band_spans, span_scores, spans_problem, static_spans
from attention.ops.window import _window_plan, window_attention

BACKENDS = ("auto", "dense", "chunked", "flex", "sdpa", "span")


def resolve_backend(name: str, rule: EdgeRule, device: torch.device, head_dim: int = 64) -> str:
    if name != "auto":
        return name
    if type(rule) is Causal:  # plain causal attention: the fused kernels' own causal path
        return "sdpa"
    # every other rule runs block-sparse at the cost of its edges: span attention on CUDA where its edges are spans
    # (GPU_CHOICES: what measured fastest), else compiled FlexAttention (also on the CPU standing in for CUDA:
    # attention/simulate_cuda.py), the chunked kernel elsewhere (and on CUDA below FlexAttention's smallest head
    # dimension)
    spans = simulate_cuda.gpu_path(device) and span_available() and not spans_problem(rule)
    if spans and GPU_CHOICES["spans"] == "span":
        return "span"
    flex_ok = simulate_cuda.gpu_path(device) and head_dim >= FLEX_MIN_HEAD_DIM
    return "flex" if flex_ok else "chunked"


@dataclass(frozen=True)
class Measured:
    """One GPU figure behind a choice of attn_backend=auto: the case, each kernel's forward + backward time."""

    case: str
    ms: dict
    device: str
    versions: str
    source: str = "docs/benchmarks.md"


# What attn_backend=auto runs on CUDA for a rule whose edges are spans (every static span rule, sa's permuted band,
# swat's sigmoid with ALiBi), and the measurements it rests on (python -m scripts.gpu_bench): the choice is the
# kernel that measured fastest in every row. A rule that is not spans runs FlexAttention.
GPU_CHOICES = {"spans": "span"}
GPU_MEASUREMENTS = {
    "spans": (
        Measured("swa, B4 H16 n=32768 d64 w256 bf16", {"span": 3.66, "flex": 5.29}, "NVIDIA H100 80GB HBM3",
                 "torch 2.11.0+cu130, Triton 3.6.0"),
        Measured("swa, B4 H16 n=8192 d64 w256 bf16", {"span": 1.27, "flex": 1.83}, "NVIDIA H100 80GB HBM3",
                 "torch 2.11.0+cu130, Triton 3.6.0"),
        Measured("swat, B4 H16 n=32768 d64 w256 bf16", {"span": 3.83, "flex": 28.56}, "NVIDIA H100 80GB HBM3",
                 "torch 2.11.0+cu130, Triton 3.6.0"),
        Measured("sa, B4 H16 n=32768 d64 w256 bf16", {"span": 8.5, "flex": 12.2}, "NVIDIA H200",
                 "torch 2.11.0+cu130, Triton 3.6.0"),
    ),
}


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


def attend(q, k, v, rule: EdgeRule, backend: str, start: int = 0, score_mod=None, activation="softmax",
           dropout_p: float = 0.0, chunk: int = 0, plan: AttentionPlan | None = None):
    """Attention of q over k, v (B, H, T, D) at positions start..start+T-1 under rule, with one backend (or the
    given plan, built by plan_attention for these arguments)."""
    if plan is None:
        plan = plan_attention(rule, backend, q.shape[2], q.shape[1], q.shape[3], q.device, start, score_mod,
                              activation, chunk)
    return attend_planned(q, k, v, plan, dropout_p)


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


def _head_subset(score_mod, heads, device):
    """score_mod for a subset of heads: local head index i is global head heads[i]."""
    if score_mod is None:
        return None
    heads = torch.tensor(heads, device=device)
    return lambda score, b, h, q_idx, kv_idx: score_mod(score, b, heads[h], q_idx, kv_idx)
