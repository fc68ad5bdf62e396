"""The window kernel: softmax attention under a rule made of disjoint windows (EdgeRule.window_tiles: paper 004's
bridge path), one batched SDPA call over one tile per window, its rows by its keys. Its reference is the dense
one (attention/ops/dense.py)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from attention import simulate_cuda
from attention.edges import EdgeRule
from attention.ops.blocks import refuse_while_compiling
from attention.ops.contract import AttentionCall, AttentionPlan, Kernel
from attention.ops.dense import fused_softmax, repeat_kv


class WindowTiles(NamedTuple):
    """The window kernel's plan: the row and key positions of every window's tile (clamped into the sequence,
    (J R,) and (J K,)), the tiles' mask (J, R, K), and which tile rows lie inside the sequence and are written
    back."""

    q_index: torch.Tensor
    k_index: torch.Tensor
    mask: torch.Tensor
    rows: torch.Tensor


def windowed(rule: EdgeRule) -> bool:
    """Whether the rule defines disjoint windows (EdgeRule.window_tiles: paper 004's bridge path)."""
    return type(rule).window_tiles is not EdgeRule.window_tiles


class WindowKernel(Kernel):
    """Chosen in place of the chunked kernel or FlexAttention (never named by attn_backend) for plain softmax over
    a rule made of disjoint windows, from position 0."""

    name = "window"
    replaces = ("chunked", "flex")
    selectable = False

    def suits(self, call: AttentionCall) -> bool:
        return windowed(call.rule) and call.start == 0 and call.plain_softmax

    def document_problem(self, call: AttentionCall) -> str:
        return ""

    def plan(self, call: AttentionCall) -> WindowTiles:
        refuse_while_compiling("the window kernel's masks")
        return window_plan(call.rule, call.n, call.device)

    def run(self, q, k, v, plan: AttentionPlan, dropout_p: float = 0.0, docs=None):
        k, v = repeat_kv(q, k, v)
        return window_attention(q, k, v, plan.rule, dropout_p, plan.data, docs)

    def scores(self, plan: AttentionPlan, n_head: int) -> int:
        return n_head * len(plan.data.rows) * plan.data.mask.shape[-1]


def window_attention(q, k, v, rule: EdgeRule, dropout_p: float = 0.0, tiles=None, docs=None):
    """Softmax attention under a rule made of disjoint windows (EdgeRule.window_tiles), one (rows x keys) tile per
    window, batched in one SDPA call: the cost is the windows' tiles, whatever n. Rows outside every window get
    zero. The tiles' mask is the rule's allowed() at their positions, and with docs (B, n: attention/documents.py)
    each batch row's same-document pairs only. tiles: window_plan(rule, n, device)."""
    B, H, n, D = q.shape
    q_index, k_index, mask, rows = window_plan(rule, n, str(q.device)) if tiles is None else tiles
    J, R, K = mask.shape
    if J == 0:  # a sequence shorter than the first window's rows
        return q * 0  # zero, with q's graph
    if docs is None:
        mask, heads = mask.expand(H, J, R, K).reshape(H * J, R, K), (B, H * J)
    else:  # per batch row; fused_softmax zeroes the rows this leaves without a key
        mask = mask & (docs.index_select(1, q_index).view(B, 1, J, R, 1) ==
                       docs.index_select(1, k_index).view(B, 1, J, 1, K))
        # SDPA's path as without documents (a 3-D mask: its math path on the CPU), so that a batch without a
        # boundary gives the same output bit for bit: on the CPU, tiles (B, H, J, ...) under each row's mask,
        # shared by its heads (n = 8K, B = 2: 0.89x the time without documents, where a mask copied for every
        # head took 1.16x); on CUDA, whose fused kernels take 4-D tiles only, the rows folded into the heads
        if simulate_cuda.gpu_path(q.device):
            mask, heads = mask.expand(B, H, J, R, K).reshape(B * H * J, R, K), (1, B * H * J)
        else:
            heads = (B, H, J)
    tiles = lambda x, index, size: x.index_select(2, index).view(*heads, size, D)  # noqa: E731
    y = fused_softmax(tiles(q, q_index, R), tiles(k, k_index, K), tiles(v, k_index, K), mask, dropout_p)
    y = y.reshape(B, H, J * R, D).index_select(2, rows)  # the tiles' rows inside the sequence, in order
    return q.new_zeros(B, H, n, D).index_copy(2, q_index.view(J * R).index_select(0, rows), y)


@functools.lru_cache(maxsize=64)
def window_plan(rule: EdgeRule, n: int, device: str) -> WindowTiles:
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
    return WindowTiles(to(q_pos.clamp(max=n - 1).flatten()), to(k_pos.clamp(max=n - 1).flatten()), to(mask), to(rows))
