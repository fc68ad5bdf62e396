"""FlexAttention under the kernel contract (attention/ops/contract.py): attn_backend=auto's pick on CUDA (and on
the CPU standing in for it) for rules whose edges are not spans. One block mask for all heads in the tokens'
order, or per group of heads (attention/ops/heads.py) in its layout or key order; with packed documents, each
batch's block masks narrowed to its documents (block_mask.py: document_block_mask) once per forward
(bind_documents), or at the call where a plan comes unbound."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from attention import simulate_cuda
from attention.layouts import KeyPrefixRule
from attention.ops.blocks import refuse_while_compiling
from attention.ops.contract import AttentionCall, AttentionPlan, Kernel
from attention.ops.dense import repeat_kv
from attention.ops.flex.block_mask import FLEX_BLOCK, document_block_mask, flex_block_mask, key_prefix
from attention.ops.flex.op import FLEX_MIN_HEAD_DIM, flex, flex_score_mod
from attention.ops.heads import HeadGroup, head_groups, may_reorder, per_group


@dataclass(eq=False)
class FlexMasks:
    """FlexAttention's plan: one BlockMask over every head in the tokens' order (block_mask), or one HeadGroup
    per group of heads in a layout or key order of its own (groups, each with its BlockMask); the score_mod in
    flex's form (flex_score_mod: over the call's positions, sigmoid as log-sigmoid)."""

    block_mask: object = None
    groups: tuple | None = None
    score_mod: object = None


@dataclass(eq=False)
class DocumentFlexMasks:
    """FlexMasks bound to one batch's documents (FlexKernel.bind_documents): `narrowed`, every block mask narrowed
    to them, which a compiled call runs as it is; and the plan's own, for an eager call (which may pad the
    sequence and plan its masks anew, narrowing them there)."""

    plan: FlexMasks
    narrowed: FlexMasks


class FlexKernel(Kernel):
    name = "flex"

    def suits(self, call: AttentionCall) -> bool:
        return call.gpu_path and call.head_dim >= FLEX_MIN_HEAD_DIM

    def document_problem(self, call: AttentionCall) -> str:
        return ""

    def plan(self, call: AttentionCall) -> FlexMasks:
        refuse_while_compiling("the flex kernel's masks")
        if simulate_cuda.simulated(call.device):  # before any block that calls flex_attention is traced
            simulate_cuda.allow_flex_cpu_backward()
        rule, n = call.rule, call.n
        in_order = not may_reorder(rule, call.start, call.score_mod)
        groups = [(heads, sub_rule, layout, None if in_order or layout is not None else
                   key_prefix(sub_rule, n, len(heads)))
                  for heads, sub_rule, layout in head_groups(rule, n, call.n_head, call.device, call.start,
                                                             call.score_mod)]
        score_mod = flex_score_mod(call.score_mod, call.start, call.activation)
        if all(layout is None and keys is None for _, _, layout, keys in groups):
            return FlexMasks(flex_block_mask(rule, n, call.n_head, call.device, call.start), None, score_mod)
        # each group in its own layout or key order, under its block mask there
        return FlexMasks(None, tuple(flex_group(heads, sub_rule, layout, keys, n, call.device)
                                     for heads, sub_rule, layout, keys in groups), score_mod)

    def bind_documents(self, plan: AttentionPlan, docs, memo: dict) -> AttentionPlan:
        data = plan.data

        def narrowed(mask, group=None):  # once per mask (and group) in a forward: the layers share their masks
            key = ("flex", id(mask), None if group is None else (id(group.layout), id(group.key_index)))
            if key not in memo:
                memo[key] = (mask, document_block_mask(mask, **(group_documents(group, docs) if group is not None
                                                                 else {"docs": docs})))
            return memo[key][1]

        if data.groups is None:
            bound = dataclasses.replace(data, block_mask=narrowed(data.block_mask))
        else:
            bound = dataclasses.replace(data, groups=tuple(dataclasses.replace(group, data=narrowed(group.data, group))
                                                           for group in data.groups))
        return AttentionPlan(plan.kernel, plan.call, DocumentFlexMasks(data, bound))

    def run(self, q, k, v, plan: AttentionPlan, dropout_p: float = 0.0, docs=None):
        data = plan.data
        if isinstance(data, DocumentFlexMasks):
            if torch.compiler.is_compiling():  # narrowed to this batch's documents once, for every layer
                data, docs = data.narrowed, None
            else:
                data = data.plan
        if data.groups is None:
            return flex(q, k, v, plan.rule, plan.start, data.score_mod, plan.activation, dropout_p,
                        block_mask=data.block_mask, docs=docs)
        k, v = repeat_kv(q, k, v)
        return per_group(q, k, v, data.groups, lambda q_g, k_g, v_g, group: flex(
            q_g, k_g, v_g, group.rule, 0, data.score_mod, plan.activation, dropout_p, block_mask=group.data,
            **group_documents(group, docs)))

    def scores(self, plan: AttentionPlan, n_head: int) -> int:
        data = plan.data.plan if isinstance(plan.data, DocumentFlexMasks) else plan.data
        if data.groups is not None:
            return sum(flex_scores(group.data, len(group.heads)) for group in data.groups)
        return flex_scores(data.block_mask, n_head)


def flex_group(heads, rule, layout, keys, n, device) -> HeadGroup:
    """A group of heads with its own block mask: over its layout's rows, or over its keys with a prefix of copies
    (keys: key_prefix's KeyPrefix)."""
    if keys is not None:
        rule = KeyPrefixRule(rule, keys.prefix_keys.to(device), keys.from_prefix.to(device), FLEX_BLOCK)
        return HeadGroup(tuple(heads), rule, flex_block_mask(rule, n, len(heads), device), None,
                         keys.index.to(device))
    return HeadGroup(tuple(heads), rule, flex_block_mask(rule, n, len(heads), device), layout)


def group_documents(group: HeadGroup, docs) -> dict:
    """flex's docs and key_docs for a group of heads: the documents of its rows (in its layout) and of its keys
    (with a prefix of copies)."""
    if docs is None:
        return {}
    if group.layout is not None:
        docs = docs.index_select(1, group.layout.token)
    return {"docs": docs, "key_docs": None if group.key_index is None else docs.index_select(1, group.key_index)}


def flex_scores(mask, n_head: int) -> int:
    """The scores a BlockMask computes over n_head heads: every entry of every block it visits."""
    blocks = mask.kv_num_blocks + (mask.full_kv_num_blocks if mask.full_kv_num_blocks is not None else 0)
    per_head = int(blocks.sum()) * (1 if blocks.shape[1] == n_head else n_head) // max(1, blocks.shape[0])
    q_block, kv_block = mask.BLOCK_SIZE
    return per_head * q_block * kv_block
