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
    window   attention/ops/window.py, chosen by the other backends for rules made of disjoint windows
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

Each kernel is a Kernel (attention/ops/contract.py) in the module or package of its algorithm, registered here in
KERNELS: it says whether it can run a call (problem), whether auto should pick it (suits), plans it (its own typed
plan), runs it and counts its scores. This module asks the registry; it knows no kernel by name but in AUTO_ORDER.
auto takes the first kernel of AUTO_ORDER that suits the call and can run it: sdpa for plain causal attention
only; on CUDA (and on the CPU standing in for it) span for every rule whose edges are spans, with no score_mod or
an ALiBi one, when Triton is installed, else flex; chunked elsewhere. A kernel that `replaces` another (window:
chunked and flex) runs in its place wherever it suits. The GPU choice is GPU_CHOICES, with the measurements
behind it (device, torch and Triton versions) beside it.

Head groups and layouts (attention/ops/heads.py, attention/layouts.py): heads with the same edges run together, each
group at its own cost (found from allowed(); head_groups() may name the rule a group runs); heads whose allowed
offsets all share a divisor d > 1 (dilated, strided rules)
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

from attention.edges import EdgeRule
from attention.ops.chunked.kernel import ChunkedKernel
from attention.ops.contract import AttentionCall, AttentionPlan, Kernel, KernelRefused, full_problem
from attention.ops.dense import DenseKernel, SdpaKernel
from attention.ops.flex.kernel import FlexKernel
from attention.ops.span.kernel import SpanKernel, span_available
from attention.ops.window import WindowKernel

# every kernel, by the name attn_backend and the plans use
KERNELS: dict[str, Kernel] = {kernel.name: kernel for kernel in (
    DenseKernel(), ChunkedKernel(), FlexKernel(), SdpaKernel(), SpanKernel(), WindowKernel())}
BACKENDS = ("auto", *(name for name, kernel in KERNELS.items() if kernel.selectable))

__all__ = ["AttentionPlan", "BACKENDS", "GPU_CHOICES", "GPU_MEASUREMENTS", "KERNELS", "attend", "attend_apart",
           "attend_paths", "attend_planned", "bind_documents", "computed_scores", "layer_scores", "plan_attention",
           "plans_in", "resolve_backend", "span_available"]


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
        # the H100 run of 2026-11-27 night (docs/history/benchmarks-2026-11.md); that evening: 3.59 / 4.85,
        # 1.29 / 1.49, swat 3.11 / 28.76; the first run that day: 3.66 / 5.29, 1.27 / 1.83, swat 3.83 / 28.56
        Measured("swa, B4 H16 n=32768 d64 w256 bf16", {"span": 3.62, "flex": 4.88}, "NVIDIA H100 80GB HBM3",
                 "torch 2.11.0+cu130, Triton 3.6.0"),
        Measured("swa, B4 H16 n=8192 d64 w256 bf16", {"span": 1.42, "flex": 1.46}, "NVIDIA H100 80GB HBM3",
                 "torch 2.11.0+cu130, Triton 3.6.0"),
        Measured("swat, B4 H16 n=32768 d64 w256 bf16", {"span": 3.28, "flex": 27.43}, "NVIDIA H100 80GB HBM3",
                 "torch 2.11.0+cu130, Triton 3.6.0"),
        Measured("sa, B4 H16 n=32768 d64 w256 bf16", {"span": 8.5, "flex": 12.2}, "NVIDIA H200",
                 "torch 2.11.0+cu130, Triton 3.6.0"),
    ),
}
# the order in which auto asks the kernels (each suits() a call or not): the fused causal kernel, then on the GPU
# path span attention where GPU_CHOICES takes it and FlexAttention, then the chunked kernel, which suits any call
AUTO_ORDER = ("sdpa", *(("span",) if GPU_CHOICES["spans"] == "span" else ()), "flex", "chunked")


def auto_kernels(call: AttentionCall):
    """The kernels auto would run for a call, best first: those of AUTO_ORDER that suit it and can run it."""
    for name in AUTO_ORDER:
        kernel = KERNELS[name]
        if kernel.suits(call) and not full_problem(kernel, call):
            yield kernel


def in_place_of(kernel: Kernel, call: AttentionCall) -> Kernel:
    """The kernel that runs a call in place of the one chosen (one that `replaces` it and suits the call), or it."""
    return next((other for other in KERNELS.values() if kernel.name in other.replaces and other.suits(call)), kernel)


def resolve_backend(name: str, rule: EdgeRule, device: torch.device, head_dim: int = 64,
                    documents: bool = False) -> str:
    """The kernel attn_backend=name picks for a rule on a device, before planning (auto: its first choice)."""
    if name != "auto":
        return name
    return next(auto_kernels(AttentionCall(rule, 0, 1, head_dim, str(device), documents=documents))).name


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
                   score_mod=None, activation: str = "softmax", chunk: int = 0,
                   documents: bool = False) -> AttentionPlan:
    """The plan attend_planned runs for attention of n queries at positions start.. under rule (see
    AttentionPlan): the kernel attn_backend names (or auto's first choice that plans it), or the one that runs
    in its place. documents: run() will get each batch's documents (attention/documents.py). Call it outside
    compiled code; it refuses to run while torch.compile traces."""
    if activation not in ("softmax", "sigmoid"):
        raise ValueError(f"unknown attention activation {activation!r}: expected softmax or sigmoid")
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    call = AttentionCall(rule, n, n_head, head_dim, str(device), start, score_mod, activation, chunk, documents)
    if backend != "auto":
        problem = full_problem(KERNELS[backend], call)
        if problem:
            raise ValueError(f"attn_backend={backend}: {problem}")
    for chosen in auto_kernels(call) if backend == "auto" else [KERNELS[backend]]:
        kernel = in_place_of(chosen, call)
        if kernel is not chosen and full_problem(kernel, call):
            kernel = chosen
        try:
            data = kernel.plan(call)
        except KernelRefused as refused:
            if backend != "auto":
                raise ValueError(f"attn_backend={backend}: {refused}") from None
            continue  # auto: the next best
        return AttentionPlan(kernel.name, call, data)
    raise AssertionError("the chunked kernel suits every call and masks documents")  # auto_kernels ends with it


def computed_scores(plan: AttentionPlan, n_head: int) -> int:
    """The attention scores a plan's kernel computes over all heads: every tile or block it evaluates, allowed
    edges and masked ones alike (what it costs), against which a rule's allowed edges (EdgeRule.count_edges)
    show whether its cost follows them. Query rows past the sequence's end are not counted."""
    return KERNELS[plan.kernel].scores(plan, n_head)


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
           dropout_p: float = 0.0, chunk: int = 0, plan: AttentionPlan | None = None, docs=None):
    """Attention of q over k, v (B, H, T, D) at positions start..start+T-1 under rule, with one backend (or the
    given plan, built by plan_attention for these arguments); docs: each token's document (attention/documents.py)
    to mask edges between documents, or None."""
    if plan is None:
        plan = plan_attention(rule, backend, q.shape[2], q.shape[1], q.shape[3], q.device, start, score_mod,
                              activation, chunk, documents=docs is not None)
    return attend_planned(q, k, v, plan, dropout_p, docs)


def attend_planned(q, k, v, plan: AttentionPlan, dropout_p: float = 0.0, docs=None):
    """Run a plan from plan_attention on q (B, H, n, D) and k, v (B, H or fewer, n, D: grouped-query attention,
    which SDPA and FlexAttention take as it is and the other kernels with k and v repeated); docs (B, n) for a
    plan made with documents (and only then)."""
    if (docs is not None) != plan.documents:
        raise ValueError("a plan made with documents runs with docs, and one made without runs without them")
    if docs is None:
        return KERNELS[plan.kernel].run(q, k, v, plan, dropout_p)
    return KERNELS[plan.kernel].run(q, k, v, plan, dropout_p, docs)


def bind_documents(plans: list, docs) -> list:
    """Every layer's plans (what each Mixer.plan returned, GPT.plan) bound to one batch's documents by their kernels
    (Kernel.bind_documents): FlexAttention's block masks narrowed to the documents once per forward and shared by
    every layer with the same masks, not narrowed again at each layer's call. An AttentionPlan at the top of a
    layer's plan or in its tuple of paths is bound; sa's plans (whose layouts gather the documents themselves)
    stay as they are."""
    if docs is None:
        return plans
    memo = {}

    def bind(plan):
        if isinstance(plan, AttentionPlan):
            return KERNELS[plan.kernel].bind_documents(plan, docs, memo) if plan.documents else plan
        if isinstance(plan, tuple):
            return tuple(bind(item) for item in plan)
        return plan
    return [bind(plan) for plan in plans]


def attend_paths(q, k, v, plans, dropout_p: float = 0.0, docs=None):
    """The sum of attend_planned over several plans (a layer's separately normalised paths): in one call where
    their kernel fuses the sum (Kernel.run_sum: span attention's two paths), else each plan's output added."""
    if len(plans) > 1 and len({p.kernel for p in plans}) == 1 and all(p.documents == (docs is not None)
                                                                      for p in plans):
        out = KERNELS[plans[0].kernel].run_sum(q, k, v, tuple(plans), dropout_p, docs)
        if out is not None:
            return out
    return sum(attend_planned(q, k, v, plan, dropout_p, docs) for plan in plans)


def attend_apart(q, k, v, plans, layouts, dropout_p: float = 0.0, docs=None):
    """Each plan's output over the same q, k, v (a layer's paths with outputs of their own; layouts: each plan's
    layout or None, as attend_in_layout takes it) in one call whose backward adds the paths' gradients in the
    kernels, where their kernel fuses it (Kernel.run_apart: span attention's two paths); None where it does not
    (the caller runs each plan)."""
    if len({p.kernel for p in plans}) != 1 or any(p.documents != (docs is not None) for p in plans):
        return None
    return KERNELS[plans[0].kernel].run_apart(q, k, v, tuple(plans), tuple(layouts), dropout_p, docs)


def attend_in_layout(q, k, v, plan: AttentionPlan, layout, dropout_p: float = 0.0, docs=None):
    """attend_planned for a plan over a layout's rows (attention/layouts.py), with q, k, v (B, H, n, D) and docs
    in token order, where the plan's kernel reads each row at its token (Kernel.run_in_layout); None where it
    does not (the caller gathers q, k, v to the layout and scatters the output back)."""
    if (docs is not None) != plan.documents:
        raise ValueError("a plan made with documents runs with docs, and one made without runs without them")
    return KERNELS[plan.kernel].run_in_layout(q, k, v, plan, layout, dropout_p, docs)
