"""Span attention under the kernel contract (attention/ops/contract.py): attn_backend=auto's pick on CUDA (and on
the CPU standing in for it) for every rule whose edges are spans, softmax or sigmoid, without a score_mod or
with ALiBi's (computed in the kernel), with or without packed documents."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention import simulate_cuda
from attention.edges import EdgeRule
from attention.ops.blocks import refuse_while_compiling
from attention.ops.contract import AttentionCall, AttentionPlan, Kernel, KernelRefused, refuse_dropout
from attention.ops.score_mod import ScoreBias
from attention.ops.span.op import (span_attention, span_blocks, span_pair_apart, span_pair_attention,
                                   triton_installed)
from attention.ops.span.spans import Spans, band_spans, span_scores, spans_problem, static_spans


@dataclass(eq=False)
class SpanPlan:
    """Span attention's plan: the rule's spans (attention/ops/span/spans.py) and its ALiBi bias, if any."""

    spans: Spans
    slopes: torch.Tensor | None = None
    offset: float = 0.0


def span_available() -> bool:
    """Whether span attention's kernels can run: Triton installed (on CUDA; its interpreter or the reference on
    the CPU standing in for it)."""
    return triton_installed() or simulate_cuda.stand_ins()


def span_bias(score_mod):
    """(slopes, offset) of an ALiBi score_mod for span attention, (None, 0.0) without one, None for other score_mods."""
    if score_mod is None:
        return None, 0.0
    return score_mod.alibi() if isinstance(score_mod, ScoreBias) else None


class SpanKernel(Kernel):
    name = "span"

    def problem(self, call: AttentionCall) -> str:
        why = spans_problem(call.rule)
        if not why and span_bias(call.score_mod) is None:
            why = "a score_mod other than ALiBi"
        if not why and not call.rule.static and call.start:
            why = "a rule drawn per forward runs as spans only from position 0"
        return f"{why} ({type(call.rule).__name__}); use auto, flex, chunked or dense" if why else ""

    def suits(self, call: AttentionCall) -> bool:
        return call.gpu_path and span_available()

    def document_problem(self, call: AttentionCall) -> str:
        return ""

    def plan(self, call: AttentionCall) -> SpanPlan:
        spans = plan_spans(call.rule, call.n, call.n_head, call.start, call.device)
        if spans is None:
            raise KernelRefused(f"some query's allowed keys are not one contiguous run in these {call.n_head} heads "
                                f"({type(call.rule).__name__}); use auto, flex, chunked or dense")
        slopes, offset = span_bias(call.score_mod)
        return SpanPlan(spans, None if slopes is None else slopes.to(call.device).float(), float(offset))

    def run(self, q, k, v, plan: AttentionPlan, dropout_p: float = 0.0, docs=None):
        refuse_dropout("span", dropout_p)
        data = plan.data
        return span_attention(q, k, v, data.spans, data.slopes, data.offset, plan.activation == "sigmoid", docs,
                              plan.start)

    def run_in_layout(self, q, k, v, plan: AttentionPlan, layout, dropout_p: float = 0.0, docs=None):
        # a band over a layout's rows in an order (sa): the kernels read and write each row at its token
        if not in_slots(plan, layout, q.shape[2]):
            return None
        refuse_dropout("span", dropout_p)
        return span_attention(q, k, v, plan.data.spans, docs=docs, halo=layout.halo)

    def run_sum(self, q, k, v, plans: tuple, dropout_p: float = 0.0, docs=None):
        # two softmax paths in token order (the bridges' block and window paths): the second pass adds the first's
        # output and gradients in as it stores its own
        if len(plans) != 2 or dropout_p or not all(plain(p) and p.start == plans[0].start for p in plans):
            return None
        return span_pair_attention(q, k, v, plans[0].data.spans, plans[1].data.spans, docs, plans[0].start)

    def run_apart(self, q, k, v, plans: tuple, layouts: tuple, dropout_p: float = 0.0, docs=None):
        # two softmax paths from position 0, the first in token order or in slots (sa_swa's sa), the second in token
        # order (its swa): the second pass adds its gradients into the first's as it stores them
        if len(plans) != 2 or layouts[1] is not None or not plain(plans[1]) or plans[1].start:
            return None
        halo = -1
        if layouts[0] is not None:
            if not in_slots(plans[0], layouts[0], q.shape[2]):
                return None
            halo = layouts[0].halo
        elif not plain(plans[0]) or plans[0].start:
            return None
        refuse_dropout("span", dropout_p)
        return span_pair_apart(q, k, v, plans[0].data.spans, plans[1].data.spans, docs, halo)

    def scores(self, plan: AttentionPlan, n_head: int) -> int:
        halo = getattr(plan.rule, "halo", 0) if plan.data.spans.order is not None else 0
        # a band over a layout's rows runs in slots (run_in_layout): its queries are the main rows only
        return span_scores(plan.data.spans, n_head, *span_blocks("cuda"), rows=slice(halo, plan.n - halo))


def plain(plan: AttentionPlan) -> bool:
    """Whether a plan is softmax over spans in token order, without a bias."""
    return plan.data.spans.order is None and plan.data.slopes is None and plan.activation == "softmax"


def in_slots(plan: AttentionPlan, layout, n: int) -> bool:
    """Whether a plan over a layout's rows runs in slots for n tokens: softmax over a band in an order, without a
    bias, from position 0, the layout's main rows each slot once (no runs)."""
    data = plan.data
    return (data.spans.order is not None and layout.runs is None and data.slopes is None
            and plan.activation == "softmax" and not plan.start and plan.n == n + 2 * layout.halo)


def plan_spans(rule: EdgeRule, n: int, n_head: int, start: int, device: str) -> Spans | None:
    """The spans of a rule at a length: a rule drawn per forward as its band in its token order, a static one from
    its edges (cached); None where some row's keys are not one run."""
    if not rule.static:
        return band_spans(rule, n, device)
    refuse_while_compiling("span attention's spans")
    return static_spans(rule, n, n_head, start, device)
