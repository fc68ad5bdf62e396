"""Block attention with boundary bridges (paper 004): bridge, pbb, se_bridge.

Fixed blocks of b positions cut every dependency across a block boundary, at any depth (004 Theorem 1). The
three variants add the `block(b)` path a causal window across each boundary (BoundaryWindows, below: the one
definition of their sources and write-back sets):

    bridge      sources and write-back [p - w/2, p + w/2)
    pbb         sources [p - w/2, p + w/2), write-back [p, p + w/2)   (pre-boundary write-back adds no source:
                                                                       004 Proposition 2)
    se_bridge   sources [p - b, p + e), write-back [p, p + e)

bridge_fusion=branch (the paper's trained models, Eq. 34-36): the block path and the bridge path are two
separately normalised softmaxes over the same q, k, v, summed in value space before the shared output
projection; positions outside every write-back set get zero from the bridge path, and no parameter is
added. bridge_fusion=union (the paper's 7B probe): one softmax over the union of block and bridge edges.

Kernels (attention/kernels.py), never n x n: in the branch form the block path runs block by block (the
chunked kernel's b x b tiles on CPU, FlexAttention's block mask on CUDA) and the bridge path window by window
(attention/ops/window.py: one batched SDPA call over one tile per boundary, its write-back rows by its sources:
(w/2) x w for pbb, e x (b + e) for se_bridge, w x w for bridge), on every backend but the dense reference.
The union form runs the chunked kernel's band on CPU and FlexAttention on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention.edges import AnyOf, EdgeRule, FixedBlock
from attention.kernels import resolve_backend
from attention.layer import MaskedAttention
from attention.local import BLOCK_LEN
from attention.memory import F32, attention_saved, kernel_saved, linear_inputs, rope_tables, window_path_saved
from attention.registry import Setting, refuse_whole_context, register

BRIDGE_WIDTH = Setting("bridge_width", int, 128, "bridge, pbb: w, the window [p - w/2, p + w/2) around each boundary p")
BRIDGE_EXTENSION = Setting("bridge_extension", int, 64, "se_bridge: e, each block's sources extended by e positions past "
                           "its end")
BRIDGE_FUSION = Setting("bridge_fusion", str, "branch", "branch: block and bridge softmaxes summed (paper's models) | "
                        "union: one softmax")

FUSIONS = ("branch", "union")


# ---- the bridge path's rule: causal windows across the boundaries of fixed blocks -------------------------

BRIDGE_KINDS = ("bridge", "pbb", "se_bridge")


@dataclass(frozen=True)
class BoundaryWindows(EdgeRule):
    """The bridge path of paper 004 (Sec. 4, Table 1): one causal window per block boundary p = j b, j >= 1.
    Window j has a source interval and a write-back set:

        bridge     sources [p - w/2, p + w/2)    write-back [p - w/2, p + w/2)
        pbb        sources [p - w/2, p + w/2)    write-back [p, p + w/2)           (post-boundary bridge)
        se_bridge  sources [p - b, p + e)        write-back [p, p + e)             (the source-extended block
                                                                                    [s, s + b + e), s = p - b)

    A position in window j's write-back set attends causally to the window's sources: k in [start_j, q].
    Write-back sets never overlap (the settings are checked), so every position gets at most one window and
    positions outside every write-back set have no bridge edges (their bridge output is zero).
    `width` is w for bridge and pbb, e for se_bridge.

    Within the configured context the boundaries are the paper's, j = 1 .. ceil(context / b) - 1: the first
    boundary at or past the context's end (j = last_window + 1) is not one in training, so the bridge kind's
    pre-boundary half of its window is never written back. Past the context every boundary is bridged as in
    training, so a model keeps its trained local structure at any evaluation length. A position's edges
    depend on its position alone, never on how many tokens follow it.
    """

    kind: str = "pbb"
    block: int = 128
    width: int = 128
    context: int = 1024

    @property
    def last_window(self) -> int:
        """The last window inside the configured context."""
        return -(-self.context // self.block) - 1

    @property
    def lookback(self):
        return self.width - 1 if self.kind != "se_bridge" else self.block + self.width - 1

    def source(self, j):
        """[start, end) of window j's sources (j an int or a tensor; not cropped to the sequence)."""
        p = j * self.block
        if self.kind == "se_bridge":
            return p - self.block, p + self.width
        return p - self.width // 2, p + self.width // 2

    def window_of(self, q):
        """The window whose write-back set holds position q (a tensor), 0 where there is none."""
        j, r = q // self.block, q % self.block
        if self.kind == "bridge":  # post-boundary half of window j, pre-boundary half of window j + 1
            half = self.width // 2
            pre = r >= self.block - half
            j = torch.where(r < half, j, torch.where(pre, j + 1, 0))
            j = torch.where(pre & (j == self.last_window + 1), 0, j)  # the context's end is not a boundary
        else:
            j = torch.where(r < (self.width // 2 if self.kind == "pbb" else self.width), j, 0)
        return torch.where(j >= 1, j, 0)

    def _windows(self, n):
        """The windows whose write-back sets start inside [0, n): their indices and sources' [start, end)."""
        j = torch.arange(1, max(self.last_window, -(-n // self.block)) + 1)
        start, end = self.source(j)
        written_from = end - (self.width if self.kind != "pbb" else self.width // 2)
        if self.kind == "bridge":  # only the post-boundary half of window last_window + 1 is written back
            written_from = torch.where(j == self.last_window + 1, j * self.block, written_from)
        inside = written_from < n
        return j[inside], start[inside], end[inside]

    def allowed(self, q, k, h=None):
        j = self.window_of(q)
        return (j >= 1) & (k >= self.source(j)[0]) & (k <= q)

    def key_runs(self, q, h=None):
        j = self.window_of(q)
        return [(torch.where(j >= 1, self.source(j)[0], 0), torch.where(j >= 1, q + 1, 0))]

    def window_tiles(self, n):
        # each window's write-back rows over its sources up to the last row: the bridge path's only scores
        # (rows a window does not write back, the pre-boundary half at the context's end, are masked out)
        _, first_key, end = self._windows(n)
        rows = self.width if self.kind != "pbb" else self.width // 2
        keys = self.width if self.kind != "se_bridge" else self.block + self.width
        return end - rows, first_key, rows, keys  # write-back sets end where the sources do

    def computed_scores(self, n: int) -> int:
        """Scores the branch form computes over n positions: each window's whole causal triangle over its
        sources inside the sequence, before write-back pruning (paper 004's Table 2 accounting)."""
        _, starts, ends = self._windows(n)
        sizes = [min(n, int(end)) - max(0, int(start)) for start, end in zip(starts, ends)]
        return sum(size * (size + 1) // 2 for size in sizes)


class BridgedBlockAttention(MaskedAttention):
    paper = "004"
    summary = "`block(b)` plus a causal window across every block boundary p = jb (Table 1)"
    kind = ""
    settings = MaskedAttention.settings + (BLOCK_LEN, BRIDGE_WIDTH, BRIDGE_FUSION)
    check_variants = {"union": {"bridge_fusion": "union"}}  # one softmax over both paths (the paper's 7B probe)

    @classmethod
    def example_settings(cls, window):
        if cls.kind == "se_bridge":
            return {"block_len": window, "bridge_extension": max(1, window // 2)}
        return {"block_len": window, "bridge_width": window}

    @classmethod
    def width(cls, config) -> int:
        return config.bridge_extension if cls.kind == "se_bridge" else config.bridge_width

    @classmethod
    def check_config(cls, config):
        super().check_config(config)
        b, width = config.block_len, cls.width(config)
        if b < 1:
            raise ValueError(f"block_len={b}: must be >= 1")
        refuse_whole_context(config, "block_len", b, "one block holds (no boundary to bridge)")
        if config.bridge_fusion not in FUSIONS:
            raise ValueError(f"bridge_fusion={config.bridge_fusion!r}: expected branch or union")
        # write-back sets of neighbouring windows must not overlap (one bridge window per position)
        if cls.kind == "se_bridge" and not 1 <= width <= b:
            raise ValueError(f"bridge_extension={width}: must be in [1, block_len={b}] (a block's extension "
                             "must not reach past the next block)")
        if cls.kind != "se_bridge":
            limit = b if cls.kind == "bridge" else 2 * b
            if width < 2 or width % 2 or width > limit:
                raise ValueError(f"bridge_width={width}: must be even, >= 2 and <= {limit} for {cls.kind} with "
                                 f"block_len={b} (wider windows would overlap)")

    def __init__(self, config, layer_idx: int):
        self.block_rule = FixedBlock(config.block_len)
        self.bridge_rule = BoundaryWindows(self.kind, config.block_len, self.width(config), config.block_size)
        self.fusion = config.bridge_fusion
        # the union of the edges: the union form's rule, and what caches and reachability need in both forms
        super().__init__(config, layer_idx, AnyOf((self.block_rule, self.bridge_rule)))

    def paths(self):
        # union: one softmax over the union of the edges (self.rule); branch: block and bridge paths summed
        return (self.rule,) if self.fusion == "union" else (self.block_rule, self.bridge_rule)

    def edge_counts(self, seq_len):
        unique = self.rule.count_edges(seq_len)
        if self.fusion == "union":
            return [(unique, unique)] * self.n_head
        computed = self.block_rule.count_edges(seq_len) + self.bridge_rule.computed_scores(seq_len)
        return [(computed, unique)] * self.n_head

    def write_back_coverage(self, seq_len) -> int:
        """Positions that receive a bridge output (004 Table 2's last column)."""
        return int((self.bridge_rule.window_of(torch.arange(seq_len)) > 0).sum())

    def describe(self):
        size = f"extension e = {self.bridge_rule.width}" if self.kind == "se_bridge" else f"w = {self.bridge_rule.width}"
        return f"block {self.block_rule.block} + {self.kind} windows ({size}), {self.fusion} fusion"

    def saved_activations(self, m, k, B: int, T: int):
        """Branch fusion: the block path is attention under block(b) (attention_saved's kernel terms) and the
        bridge path runs window by window (window_path_saved), or as span attention on CUDA; the union form is plain
        attention under one rule."""
        if self.fusion == "union":
            return attention_saved(self, m, k, B, T)
        C, H, D, a, tokens = m.n_embd, m.n_head, m.head_dim, k.act, B * T
        saved = {"c_attn input": tokens * linear_inputs(k, 1, C), "qkv": 3 * a * C * tokens}
        if self.rope_theta is not None:
            saved["q, k after RoPE"] = 2 * a * C * tokens
            saved["RoPE cos/sin tables"] = rope_tables(T, D)
        kernel = resolve_backend(self.backend, self.block_rule, torch.device(k.device), D)
        saved.update(kernel_saved(kernel, self.block_rule, "softmax", k, B, H, D, T))
        bridge_kernel = resolve_backend(self.backend, self.bridge_rule, torch.device(k.device), D)
        if bridge_kernel == "span":  # span attention over the windows' rows: an output and lse per position
            for name, size in kernel_saved("span", self.bridge_rule, "softmax", k, B, H, D, T).items():
                saved["bridge " + name] = size
            bridge_out = a * B * H * T * D + F32 * B * H * T
        else:
            saved.update(window_path_saved(self.bridge_rule, k, B, H, D, T))
            first_row, _, R, _ = self.bridge_rule.window_tiles(T)
            bridge_out = (a * D + F32) * B * H * len(first_row) * R
        saved["merged heads"] = a * C * tokens
        if self.gate is not None:
            saved["output gate"] = 2 * a * C * tokens
        kernel_out = a * tokens * C + F32 * B * H * T + bridge_out
        matmuls = a * tokens * (4 * C + (C if self.gate is not None else 0))
        return saved, matmuls + kernel_out

@register("bridge")
class Bridge(BridgedBlockAttention):
    kind = "bridge"


@register("pbb")
class PostBoundaryBridge(BridgedBlockAttention):
    kind = "pbb"


@register("se_bridge")
class SourceExtendedBridge(BridgedBlockAttention):
    kind = "se_bridge"
    settings = tuple(s for s in BridgedBlockAttention.settings if s is not BRIDGE_WIDTH) + (BRIDGE_EXTENSION,)
