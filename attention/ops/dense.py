"""The dense reference every kernel is held to: explicit (B, H, Tq, Tk) scores under a rule's mask (or any boolean
mask), in float32 or better, on any device, O(n^2); and SDPA under a boolean mask, through which the block-sparse
kernels also run their tiles."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attention import simulate_cuda
from attention.documents import document_mask
from attention.edges import Causal, EdgeRule
from attention.ops.blocks import refuse_while_compiling
from attention.ops.contract import AttentionCall, AttentionPlan, Kernel


def repeat_kv(q, k, v):
    """Grouped-query attention's k and v (B, H_kv, T, D) repeated to q's heads (each k/v head serves
    H / H_kv consecutive query heads), for kernels that take one k/v head per query head."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


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
        return fused_softmax(q, k, v, mask, dropout_p)
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


def sdpa(q, k, v, **options):
    """F.scaled_dot_product_attention (grouped keys as needed); its output is laid out as CUDA's kernels lay it
    out (not contiguous) on CUDA and on the CPU standing in for it."""
    y = F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1], **options)
    return simulate_cuda.sdpa_output_layout(y) if simulate_cuda.simulated(q.device) else y


def fused_softmax(q, k, v, mask, dropout_p=0.0):
    """SDPA under a boolean mask; a query with no allowed key gets a zero output, as in the explicit path.

    (SDPA alone returns NaN for such rows: here they attend to every key and their output is zeroed.)
    """
    has_key = mask.any(-1, keepdim=True)  # applied unconditionally: a data-dependent branch would sync GPUs
    y = sdpa(q, k, v, attn_mask=mask | ~has_key, dropout_p=dropout_p)
    return y * has_key


def dense_attention(q, k, v, rule: EdgeRule, q_pos, k_pos=None, key_valid=None, score_mod=None,
                    activation="softmax", dropout_p: float = 0.0, fused: bool = False, docs=None):
    """The reference: explicit scores over all (query, key) pairs, masked by the rule (and, given docs (B, T) of a
    sequence's tokens, by its documents: attention/documents.py)."""
    k_pos = q_pos if k_pos is None else k_pos
    mask = rule.dense_mask(q_pos, k_pos, n_head=q.shape[1])
    if key_valid is not None:
        mask = mask & key_valid
    if docs is not None:
        mask = mask & document_mask(docs)
    return masked_attention(q, k, v, mask, q_pos, k_pos, score_mod, activation, dropout_p, fused=fused)


class DensePlan:
    """The dense kernel plans nothing: it builds its mask from the rule at every call."""


class DenseKernel(Kernel):
    """The reference as a kernel (attn_backend=dense): explicit scores, O(n^2); never auto's pick."""

    name = "dense"

    def document_problem(self, call: AttentionCall) -> str:
        return ""

    def plan(self, call: AttentionCall) -> DensePlan:
        return DensePlan()

    def run(self, q, k, v, plan: AttentionPlan, dropout_p: float = 0.0, docs=None):
        k, v = repeat_kv(q, k, v)
        pos = torch.arange(plan.start, plan.start + q.shape[2], device=q.device)
        return dense_attention(q, k, v, plan.rule, pos, score_mod=plan.score_mod, activation=plan.activation,
                               dropout_p=dropout_p, docs=docs)

    def scores(self, plan: AttentionPlan, n_head: int) -> int:
        return n_head * plan.n * (plan.start + plan.n)


def per_document_causal(q, k, v, docs, dropout_p=0.0):
    """Causal attention with each document of each row run on its own through SDPA's causal kernel: the edges of
    the documents only (their boundaries read on the host: the CPU's path)."""
    begins = (docs[:, 1:] != docs[:, :-1]).nonzero().tolist()  # (row, index - 1) of every document but the first
    rows = []
    for b in range(q.shape[0]):
        bounds = [0, *(i + 1 for row, i in begins if row == b), q.shape[2]]
        pieces = [sdpa(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e], dropout_p=dropout_p, is_causal=True)
                  for s, e in zip(bounds, bounds[1:])]
        rows.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, 2))
    return rows[0] if len(rows) == 1 else torch.cat(rows, 0)


class SdpaMask:
    """SDPA's plan: a dense boolean mask (H or 1, n, start + n), or None for causal attention from position 0
    (the fused kernels' own causal path)."""

    def __init__(self, mask: torch.Tensor | None):
        self.mask = mask


class SdpaKernel(Kernel):
    """PyTorch's fused SDPA: is_causal for the causal rule, else under the rule's dense mask (O(n^2) memory);
    auto's pick for plain causal attention."""

    name = "sdpa"

    def problem(self, call: AttentionCall) -> str:
        return "" if call.plain_softmax else "it supports plain softmax attention only; use dense, chunked or flex"

    def suits(self, call: AttentionCall) -> bool:
        return type(call.rule) is Causal

    def document_problem(self, call: AttentionCall) -> str:
        # causal attention runs each document on its own, found on the host: the CPU's way (fewer edges, less
        # time); on CUDA that would synchronise, and FlexAttention's document mask runs instead
        if self.causal_from_start(call) and call.gpu_path:
            return "on CUDA its documents would be found on the host: use attn_backend=flex or auto"
        return ""

    @staticmethod
    def causal_from_start(call: AttentionCall) -> bool:
        return isinstance(call.rule, Causal) and call.start == 0

    def plan(self, call: AttentionCall) -> SdpaMask:
        if self.causal_from_start(call):
            return SdpaMask(None)
        refuse_while_compiling("sdpa's dense mask")
        pos = torch.arange(call.start, call.start + call.n, device=call.device)
        return SdpaMask(call.rule.dense_mask(pos, n_head=call.n_head))

    def run(self, q, k, v, plan: AttentionPlan, dropout_p: float = 0.0, docs=None):
        if plan.data.mask is None:
            if docs is not None:
                return per_document_causal(q, k, v, docs, dropout_p)
            return sdpa(q, k, v, dropout_p=dropout_p, is_causal=True)
        mask = plan.data.mask if docs is None else plan.data.mask & document_mask(docs)
        return fused_softmax(q, k, v, mask, dropout_p)

    def scores(self, plan: AttentionPlan, n_head: int) -> int:
        if plan.data.mask is None:  # causal from position 0: the fused kernels skip the tiles above the diagonal
            return n_head * plan.n * (plan.n + 1) // 2
        return n_head * plan.n * (plan.start + plan.n)
