"""Stochastic attention (paper 000): sliding-window attention over a random permutation of the tokens.

    sa       each layer draws a uniform permutation sigma per forward, shared by its heads; tokens are gathered
             into slot order, attend within the circular window |sigma(i) - sigma(j)|_n < w/2 of slot space
             intersected with causality in original positions (j <= i), and are scattered back. RoPE was
             applied at the original positions before the gather.
    sa_swa   shared q/k/v, an sa path and an swa path, each through its own sigmoid gate sigmoid(W Y) * Y
             (W d x d, no bias), summed, then the output projection (Alg. 2). attn_gate does not apply:
             the two path gates replace the single gate of the one-path variants.

The edge is defined once (stochastic_window_edges, below). The dense backend evaluates it over
all (query, key) pairs in original positions (StochasticWindow, the O(n^2) reference); every other backend
runs in permuted space, where it is a band (PermutedWindow): the chunked kernel and FlexAttention cost
O(n w) plus an O(n) gather and scatter; span attention reads each slot from its token's row inside its loads
(Kernel.run_in_layout), so nothing is gathered or scattered around it; sa_swa's two paths run there in one op
(Kernel.run_apart) whose backward adds swa's gradients into sa's in the kernels.

Permutations: training always draws fresh ones from the torch RNG (seeded per rank by train.py and restored
on resume, so a run and its resumption draw the same ones). At inference sa_mode=stochastic keeps drawing;
sa_mode=deterministic uses one fixed permutation per layer and length, from sa_seed. sa_shared_batch=False
draws one permutation per sequence instead of one per batch (deterministic mode has one per layer).
Generation re-runs the context for every token: a permutation over the grown sequence is a new one, so there
is no cache to extend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attention.call import MixerCall
from attention.edges import EdgeRule, SlidingWindow
from attention.kernels import (AttentionPlan, attend_apart, attend_in_layout, attend_planned, plan_attention,
                               resolve_backend)
from attention.layouts import Layout, extended_slots, from_layout, inverse_permutation, to_layout
from attention.layer import Attention, merge_heads
from attention.local import SWA_WINDOW
from attention.memory import F32, kernel_saved, linear_inputs, rope_tables
from attention.capabilities import own_state_problem
from attention.registry import Setting, layer_names, refuse_whole_context, register

SA_MODE = Setting("sa_mode", str, "stochastic", "sa at inference: a fresh permutation every forward | deterministic "
                  "(fixed per layer)", inference=True)
SA_SHARED_BATCH = Setting("sa_shared_batch", bool, True, "sa: one permutation for the whole batch (paper 000) or one "
                          "per sequence")
SA_SEED = Setting("sa_seed", int, 0, "sa_mode=deterministic: the fixed permutations come from this seed (training draws "
                  "from the run's RNG)", inference=True)

SA_MODES = ("stochastic", "deterministic")


def drawn_per_forward(config) -> str:
    """One line saying that a model's outputs are drawn per forward, for tools that evaluate or export it ("" when
    they are not: no sa layer, or sa_mode=deterministic)."""
    if config.sa_mode != "stochastic" or not {"sa", "sa_swa"} & set(layer_names(config)):
        return ""
    return ("its sa layers draw a fresh permutation at every forward (sa_mode=stochastic, as in paper 000): two "
            "forwards of the same input differ; --sa_mode=deterministic fixes one permutation per layer and length "
            "(from sa_seed)")


# ---- the edge: a sliding window over a random permutation -------------------------------------------------

def circular_distance(a, b, n):
    """|a - b|_n: distance between slots a and b on a ring of n slots (n None: a line, |a - b|)."""
    if n is None:
        return (a - b).abs()
    d = (a - b) % n
    return torch.minimum(d, n - d)


def in_circular_window(q_slot, k_slot, window, n):
    """Paper 000's circular window N_w (Eq. 3): slots at circular distance < window/2, the query's own included."""
    return 2 * circular_distance(q_slot, k_slot, n) < window


def stochastic_window_edges(q_slot, k_slot, q_pos, k_pos, window, n):
    """The SA edge (paper 000, Eq. 3 and App. B): the key's slot lies in the circular window of the query's
    slot in permuted space, and the key is not after the query in original positions."""
    return (k_pos <= q_pos) & in_circular_window(q_slot, k_slot, window, n)


def stochastic_halo(window: int) -> int:
    """The largest slot distance the circular window admits: distance d is inside iff 2 d < window."""
    return (window - 1) // 2


@dataclass(frozen=True, eq=False)
class StochasticWindow(EdgeRule):
    """sa(w) in original positions, for one permutation: token t sits in slot slot_of[t] (the reference form,
    used by the dense backend and the analysis tools; O(n^2) to evaluate over all pairs)."""

    slot_of: torch.Tensor = None  # (n,) slot of every token
    window: int = 256
    static = False

    def allowed(self, q, k, h=None):
        n = self.slot_of.shape[0]
        return stochastic_window_edges(self.slot_of[q], self.slot_of[k], q, k, self.window, n)


@dataclass(frozen=True, eq=False)
class PermutedWindow(EdgeRule):
    """sa(w) laid out in permuted space, where it is a band: the efficient kernels' form.

    The n slots (slot s holds token order[s]) are extended circularly by `halo` slots at both ends:
    extended slot e holds slot (e - halo) mod n, so the ring is unrolled into a line and the circular window
    becomes the band |e_q - e_k| <= halo. Queries at extended slots halo .. halo + n - 1 are the real ones;
    each finds every slot of its window exactly once inside the band (this needs 2 halo + 1 <= n: below that
    length sa is causal attention). The edge is stochastic_window_edges over the unrolled line, with the
    tokens' original positions, as in StochasticWindow.
    """

    order: torch.Tensor = None  # (n,) token in every slot
    window: int = 256
    static = False

    def __post_init__(self):
        # the original position of the token at every extended slot (the gather index of the layout)
        object.__setattr__(self, "token", self.order[self.extended_slots()])

    @property
    def halo(self):
        return stochastic_halo(self.window)

    @property
    def lookback(self):
        return self.halo

    @property
    def lookahead(self):
        return self.halo

    def extended_slots(self) -> torch.Tensor:
        """The slot held by every extended position."""
        return extended_slots(self.order.shape[0], self.halo, str(self.order.device))

    def allowed(self, q, k, h=None):
        return stochastic_window_edges(q, k, self.token[q], self.token[k], self.window, None)


@dataclass(eq=False)
class StochasticPlan:
    """One permutation's layout, drawn and planned outside compiled code (see Mixer.plan): slot s holds token
    order[s], extended circularly by the window's halo (attention/layouts.py: Layout); `layout` is None when sa
    runs unpermuted (the dense reference, or a length at which every slot is inside every window), and
    `attention` is the kernel plan over the layout's rows."""

    order: torch.Tensor
    layout: Layout | None
    attention: AttentionPlan


def plan_stochastic(order, window: int, backend: str, n_head: int, head_dim: int, device,
                    documents: bool = False) -> StochasticPlan:
    n = order.shape[0]
    if backend == "dense":  # the reference: every pair, in original positions
        return StochasticPlan(order, None, plan_attention(StochasticWindow(inverse_permutation(order), window),
                                                          "dense", n, n_head, head_dim, device, documents=documents))
    if n // 2 <= stochastic_halo(window):  # every slot is inside every window: plain causal attention
        return StochasticPlan(order, None, plan_attention(SlidingWindow(n), backend, n, n_head, head_dim, device,
                                                          documents=documents))
    layout = Layout(order, stochastic_halo(window))
    rule = PermutedWindow(order, window)  # its token at every row is the layout's
    return StochasticPlan(order, layout, plan_attention(rule, backend, layout.rows, n_head, head_dim, device,
                                                        documents=documents))


def stochastic_attention(q, k, v, order, window: int, backend: str, dropout_p: float = 0.0,
                         plan: StochasticPlan | None = None, docs=None):
    """sa(window) of q, k, v (B, H, n, D) with the tokens in slot order `order` (n,): slot s holds token
    order[s], shared by the batch and the heads (plan: plan_stochastic's for these arguments); docs (B, n):
    each token's document, which the kernel reads in the layout's row order (same document: equal values)."""
    if plan is None:
        plan = plan_stochastic(order, window, backend, q.shape[1], q.shape[3], q.device, docs is not None)
    if plan.layout is None:
        return attend_planned(q, k, v, plan.attention, dropout_p, docs)
    out = attend_in_layout(q, k, v, plan.attention, plan.layout, dropout_p, docs)
    if out is not None:  # the kernel read the slots from the tokens' rows (span attention)
        return out
    q, k, v = (to_layout(t, plan.layout) for t in (q, k, v))
    docs = None if docs is None else docs.index_select(1, plan.layout.token.to(docs.device))
    return from_layout(attend_planned(q, k, v, plan.attention, dropout_p, docs), plan.layout)


def stochastic_edge_count(n: int, window: int) -> int:
    """Allowed sa edges over n tokens, the same for every permutation: each token's window holds
    m = min(2 halo + 1, n) slots, a symmetric relation, and each unordered pair of distinct tokens in it is
    causal in exactly one direction: n + n (m - 1) / 2."""
    m = min(2 * stochastic_halo(window) + 1, n)
    return n + n * (m - 1) // 2


@register("sa")
class StochasticAttention(Attention):
    """Sliding-window attention in the slot space of a random permutation, redrawn every forward."""
    paper = "000"
    summary = "j <= i and \\|sigma(i) - sigma(j)\\|_n < w/2 for a random permutation sigma, redrawn per layer and forward"

    native_gqa = False  # its attend() permutes one k/v head per query head
    settings = Attention.settings + (SWA_WINDOW, SA_MODE, SA_SHARED_BATCH, SA_SEED)

    @classmethod
    def example_settings(cls, window):
        return {"swa_window": window}

    supports_cache = False
    takes_documents = True
    length_independent = False
    # a shard's queries: the whole sequence's keys, under one permutation for the group (mix_shard)
    context_parallel = True

    @classmethod
    def check_config(cls, config):
        super().check_config(config)
        if config.swa_window < 2:
            raise ValueError(f"swa_window={config.swa_window}: sa needs a window of at least 2 slots")
        refuse_whole_context(config, "swa_window", config.swa_window, "the circular window of slots covers")
        if config.sa_mode not in SA_MODES:
            raise ValueError(f"sa_mode={config.sa_mode!r}: expected one of {', '.join(SA_MODES)}")

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)  # no fixed rule: one is drawn per forward (plan)
        self.window = config.swa_window
        self.swa_rule = SlidingWindow(config.swa_window)  # sa_swa's local path
        self.mode = config.sa_mode
        self.shared_batch = config.sa_shared_batch
        self.seed = config.sa_seed
        self._fixed_orders = {}
        self.last_order = None  # the permutation(s) of the latest forward, (n,) or (B, n): for inspection

    def draw_orders(self, batch_size: int, n: int, device) -> torch.Tensor:
        """The slot order of this forward: (n,) shared by the batch, or (batch_size, n)."""
        if not self.training and self.mode == "deterministic":
            key = (n, str(device))
            if key not in self._fixed_orders:
                generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.layer_idx)
                self._fixed_orders[key] = torch.randperm(n, generator=generator).to(device)
            return self._fixed_orders[key]
        if self.shared_batch:
            return torch.randperm(n, device=device)
        return torch.rand(batch_size, n, device=device).argsort(dim=-1)

    def sa_plans(self, batch_size, seq_len, device, orders=None) -> tuple:
        """This forward's permutation(s), drawn now (or given), and their plans: one shared by the batch, or one
        per sequence."""
        orders = self.draw_orders(batch_size, seq_len, device) if orders is None else orders
        self.last_order = orders
        return tuple(plan_stochastic(order, self.window, self.backend, self.n_head, self.head_dim, device,
                                     self.document_mask)
                     for order in (orders[None] if orders.dim() == 1 else orders))

    def plan(self, batch_size, seq_len, device, start=0, orders=None):
        return self.sa_plans(batch_size, seq_len, device, orders)

    @torch.compiler.disable  # a collective and planning: outside compiled code
    def group_plan(self, shard, batch_size, device):
        """The plan of the whole sequence under context parallelism: the permutation the group's first process
        draws, sent to the others, so that every shard sees the same edges (and, with the same RNG state, the
        edges one process draws)."""
        orders = self.draw_orders(batch_size, shard.n, device).contiguous()
        torch.distributed.broadcast(orders, src=shard.peer(0), group=shard.group)
        return self.plan(batch_size, shard.n, device, orders=orders)

    def mix(self, q, k, v, call: MixerCall):
        if call.shard is not None:
            return self.mix_shard(q, k, v, call)
        return super().mix(q, k, v, call)

    def mix_shard(self, q, k, v, call: MixerCall):
        """Context parallelism's fallback for a rule drawn over the whole sequence: every position's keys and
        values received, the shard's queries in their rows of the whole sequence (the others zero), the layer's
        mix over it under the group's permutation, and the shard's rows kept."""
        shard = call.shard
        s, e = shard.bounds()
        kv = shard.gather_range(torch.stack([k, v]), lambda r: (0, shard.n), 3, "keys and values")
        q = torch.nn.functional.pad(q, (0, 0, s, shard.n - e))
        whole = MixerCall(torch.arange(shard.n, device=q.device), None, self.group_plan(shard, q.shape[0], q.device),
                          shard.docs)
        return self.mix(q, kv[0], kv[1], whole)[:, s:e]

    reaches_far = "its permutation reaches across the whole sequence"

    def context_parallel_received(self, shard) -> int:
        return shard.n - shard.length  # every other shard's positions

    def compile_key(self):  # the permutation is an input of the compiled block, drawn anew at every step
        return (type(self).__name__, self.window, self.swa_rule)

    def attend(self, q, k, v, call: MixerCall):
        if call.cache is not None:
            raise NotImplementedError("sa draws a new permutation every forward: generate without a cache")
        dropout_p = self.dropout if self.training else 0.0
        docs = call.docs
        plans = call.plan if call.plan is not None else self.sa_plans(q.shape[0], q.shape[2], q.device)
        if len(plans) == 1:
            return stochastic_attention(q, k, v, None, self.window, self.backend, dropout_p, plans[0], docs)
        return torch.cat([stochastic_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], None, self.window,
                                               self.backend, dropout_p, plans[b],
                                               None if docs is None else docs[b:b + 1]) for b in range(q.shape[0])])

    def init_cache(self, batch_size, max_len, device, dtype):
        raise NotImplementedError("sa draws a new permutation every forward: generate with use_cache=False")

    def describe(self):
        return f"sa window {self.window} ({self.mode} at inference, " \
               f"{'one permutation per batch' if self.shared_batch else 'one permutation per sequence'})"

    def edge_counts(self, seq_len):
        count = stochastic_edge_count(seq_len, self.window)
        return [(count, count)] * self.n_head

    def edge_mask(self, seq_len, device="cpu"):
        """The edges of one freshly drawn permutation (each call draws again, as each layer does)."""
        slot_of = inverse_permutation(torch.randperm(seq_len, device=device))
        return StochasticWindow(slot_of, self.window).dense_mask(torch.arange(seq_len, device=device))

    def saved_activations(self, m, k, B: int, T: int):
        """sa: q, k, v are gathered into the circularly extended slot sequence of n + 2 halo positions (ToLayout,
        which keeps only the permutation), attended there as a band, and scattered back (FromLayout). So the
        kernel keeps the extended q, k, v, output and lse (ext = (n + 2 halo) / n of the plain sizes) and neither
        qkv nor the rotated q, k survive the forward; the scattered output is merged into (B, T, C) (a C).
        Span attention reads the slots from the tokens' rows instead: it keeps q, k, v, output and lse of the
        plain sizes. At lengths where every slot is inside every window (n // 2 <= halo) sa is plain causal
        attention."""
        C, H, D, a, tokens = m.n_embd, m.n_head, m.head_dim, k.act, B * T
        halo = stochastic_halo(self.window)
        permuted = T // 2 > halo
        if permuted:
            sa_rule = PermutedWindow(torch.arange(T), self.window)
        else:
            sa_rule = SlidingWindow(T)
        sa_kernel = resolve_backend(self.backend, sa_rule, torch.device(k.device), D)
        gathered = permuted and sa_kernel != "span"  # span reads the slots from the tokens' rows
        n_ext = T + 2 * halo if gathered else T
        saved = {"c_attn input": tokens * linear_inputs(k, 1, C)}
        if self.rope_theta is not None:
            saved["RoPE cos/sin tables"] = rope_tables(T, D)
        saved["sa q, k, v in slot order" if gathered else "sa q, k, v"] = 3 * a * B * H * n_ext * D
        for name, size in kernel_saved(sa_kernel, sa_rule, "softmax", k, B, H, D, n_ext).items():
            saved["sa " + name] = size
        saved["sa merged heads"] = a * C * tokens
        matmuls = a * tokens * 4 * C
        kernel_out = a * B * H * n_ext * D + F32 * B * H * n_ext
        if self.gate is not None:
            saved["output gate"] = 2 * a * C * tokens
            matmuls += a * tokens * C
        return saved, matmuls + kernel_out

@register("sa_swa")
class GatedStochasticSlidingAttention(StochasticAttention):
    """sa and swa over shared q, k, v, each path through its own sigmoid gate, summed (paper 000, Alg. 2)."""
    paper = "000"
    summary = "the `sa` and `swa` paths over shared q/k/v, each through its own sigmoid gate, summed (Alg. 2)"

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.gate = None  # replaced by one gate per path
        inner = config.n_head * config.head_dim
        self.gate_sa = nn.Linear(inner, inner, bias=False)
        self.gate_swa = nn.Linear(inner, inner, bias=False)

    def plan(self, batch_size, seq_len, device, start=0, orders=None):
        return self.sa_plans(batch_size, seq_len, device, orders), plan_attention(
            self.swa_rule, self.backend, seq_len, self.n_head, self.head_dim, device, documents=self.document_mask)

    def mix(self, q, k, v, call: MixerCall):
        if call.shard is not None:
            return self.mix_shard(q, k, v, call)
        if call.cache is not None:
            raise NotImplementedError("sa draws a new permutation every forward: generate without a cache")
        y_sa, y_swa = (merge_heads(y) for y in self.both_paths(q, k, v, call.plan, call.docs))
        return torch.sigmoid(self.gate_sa(y_sa)) * y_sa + torch.sigmoid(self.gate_swa(y_swa)) * y_swa

    def both_paths(self, q, k, v, plan=None, docs=None):
        """(sa's output, swa's) over the same q, k, v: in one call where their kernel fuses them (span attention:
        sa in slots, then swa, whose backward adds its gradients into sa's in the kernels), else each on its own
        (autograd adds the gradients)."""
        dropout_p = self.dropout if self.training else 0.0
        sa_plans, swa_plan = plan if plan is not None else self.plan(q.shape[0], q.shape[2], q.device)
        if len(sa_plans) == 1:  # one permutation for the batch
            both = attend_apart(q, k, v, (sa_plans[0].attention, swa_plan), (sa_plans[0].layout, None), dropout_p,
                                docs)
            if both is not None:
                return both
        sa = self.attend(q, k, v, MixerCall(None, None, sa_plans, docs))
        return sa, attend_planned(q, k, v, swa_plan, dropout_p, docs)

    def kernel_forward(self, q, k, v, docs=None):
        """Both paths over the same q, k, v, summed (their gates are projections, left out)."""
        y_sa, y_swa = self.both_paths(q, k, v, docs=docs)
        return y_sa + y_swa

    def pretrained_problem(self):
        return own_state_problem(self)  # its two path gates are parameters of its own

    def saved_activations(self, m, k, B: int, T: int):
        """sa's (its own gate replaced by the two path gates), and the swa path over the shared q, k, v, which then
        keeps qkv and the rotated q, k; its merged output; the two sigmoid gates sigmoid(W_sa y_sa),
        sigmoid(W_swa y_swa) and their gated sum (3 a C)."""
        saved, kept = super().saved_activations(m, k, B, T)
        C, H, D, a, tokens = m.n_embd, m.n_head, m.head_dim, k.act, B * T
        saved["qkv"] = 3 * a * C * tokens
        if self.rope_theta is not None:
            saved["q, k after RoPE"] = 2 * a * C * tokens
        swa_kernel = resolve_backend(self.backend, self.swa_rule, torch.device(k.device), D)
        for name, size in kernel_saved(swa_kernel, self.swa_rule, "softmax", k, B, H, D, T).items():
            saved["swa " + name] = size
        saved["swa merged heads"] = a * C * tokens
        saved["path gates and their sum"] = 3 * a * C * tokens
        return saved, kept + 2 * a * tokens * C + a * tokens * C + F32 * B * H * T

    def describe(self):
        return f"sa + swa, window {self.window}, one sigmoid gate per path"

    def edge_counts(self, seq_len):
        """(sa + swa scores computed, edges in their union) per head; the union is counted for one seeded
        permutation (sa and swa overlap where a token's random window holds one of its w recent tokens)."""
        sa = stochastic_edge_count(seq_len, self.window)
        swa = self.swa_rule.count_edges(seq_len)
        order = torch.randperm(seq_len, generator=torch.Generator().manual_seed(self.seed))
        # swa's edges are q - k = d < w, causal already: sa's edge there is the slots' circular window, over int32
        # slices of the slots (4x faster than StochasticWindow.allowed's int64 gathers: 35 ms at n = 32K)
        slot_of = inverse_permutation(order).to(torch.int32)
        overlap = sum(int(in_circular_window(slot_of[d:], slot_of[:seq_len - d], self.window, seq_len).sum())
                      for d in range(min(self.window, seq_len)))
        return [(sa + swa, sa + swa - overlap)] * self.n_head

    def edge_mask(self, seq_len, device="cpu"):
        return super().edge_mask(seq_len, device) | self.swa_rule.dense_mask(torch.arange(seq_len, device=device))
