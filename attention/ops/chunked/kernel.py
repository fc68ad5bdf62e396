"""The chunked kernel under the kernel contract (attention/ops/contract.py): the CPU's kernel, and the last resort
of attn_backend=auto anywhere. Each group of heads (attention/ops/heads.py) gets the tiles of its own edges."""

from __future__ import annotations

from dataclasses import dataclass

from attention.ops.blocks import refuse_while_compiling
from attention.ops.chunked.op import ChunkedFlashCPU, chunked_attention, fusable
from attention.ops.chunked.tiles import cached_chunk_tiles, chunk_tiles
from attention.ops.contract import AttentionCall, AttentionPlan, Kernel
from attention.ops.dense import repeat_kv
from attention.ops.heads import HeadGroup, head_groups, head_subset, per_group


@dataclass(eq=False)
class ChunkedGroups:
    """The chunked kernel's plan: one HeadGroup per group of heads, its data the group's ChunkTiles. cpu_flash:
    whether it takes the CPU's fused flash kernel (not on CUDA, nor on the CPU standing in for it: decided here,
    outside compiled code, so that a compiled block's branch is one of its guarded inputs)."""

    groups: tuple
    cpu_flash: bool = True


class ChunkedKernel(Kernel):
    name = "chunked"

    def suits(self, call: AttentionCall) -> bool:
        return True

    def document_problem(self, call: AttentionCall) -> str:
        return ""

    def plan(self, call: AttentionCall) -> ChunkedGroups:
        refuse_while_compiling("the chunked kernel's masks")
        tiles_of = cached_chunk_tiles if call.rule.static else chunk_tiles  # a permutation's tiles are its own
        groups = tuple(
            HeadGroup(tuple(heads), sub_rule, tiles_of(sub_rule, call.n, call.start, call.chunk or sub_rule.chunk_size(),
                                                       len(heads), call.device), layout)
            for heads, sub_rule, layout in head_groups(call.rule, call.n, call.n_head, call.device, call.start,
                                                       call.score_mod))
        return ChunkedGroups(groups, cpu_flash=not call.gpu_path)

    def run(self, q, k, v, plan: AttentionPlan, dropout_p: float = 0.0, docs=None):
        k, v = repeat_kv(q, k, v)
        groups, cpu_flash = plan.data.groups, plan.data.cpu_flash
        start, score_mod, activation = plan.start, plan.score_mod, plan.activation
        if len(groups) == 1 and groups[0].layout is None:
            return chunked_attention(q, k, v, plan.rule, start, 0, score_mod, activation, dropout_p,
                                     tiles=groups[0].data, cpu_flash=cpu_flash, docs=docs)
        # each head group at its own cost (its window, its layout), not the largest one's
        order = [i for group in groups for i in group.heads]
        in_order = order == list(range(q.shape[1]))
        if in_order and fusable(score_mod) and activation == "softmax" and dropout_p == 0.0 \
                and q.device.type == "cpu" and cpu_flash:
            # one fused call writing every group into the output, each group's tiles read through its layout
            bounds, first = [], 0
            for group in groups:
                bounds.append((first, first + len(group.heads), group.data, group.layout))
                first += len(group.heads)
            return ChunkedFlashCPU.apply(q, k, v, tuple(bounds), score_mod, start, docs)

        def run(q_g, k_g, v_g, group):
            group_docs = docs if docs is None or group.layout is None else docs.index_select(1, group.layout.token)
            return chunked_attention(q_g, k_g, v_g, group.rule, start, 0, head_subset(score_mod, group.heads, q.device),
                                     activation, dropout_p, tiles=group.data, cpu_flash=cpu_flash, docs=group_docs)
        return per_group(q, k, v, groups, run)

    def scores(self, plan: AttentionPlan, n_head: int) -> int:
        return sum(len(group.heads) * group.data.scores(plan.n, len(group.heads)) for group in plan.data.groups)
