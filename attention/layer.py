"""Multi-head self-attention: the plumbing every attention variant shares, and attention under an edge rule.

`Attention` owns the q/k/v projection, RoPE at the tokens' original positions, the optional sigmoid output
gate and the output projection; a subclass implements `attend`, mapping per-head q, k, v (B, H, T, D) to
per-head outputs. `MaskedAttention` is attention under one edge rule, run by the configured kernel backend,
with the matching generation cache; most variants only say which rule (see attention/local.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attention.cache import KVCache, RollingKVCache
from attention.call import MixerCall
from attention.capabilities import EdgeCounts, own_state_problem
from attention.documents import keys_in_document, packed_document_starts
from attention.edges import AnyOf, EdgeRule
from attention.kernels import BACKENDS, attend_paths, plan_attention
from attention.memory import attention_saved
from attention.ops.dense import masked_attention, repeat_kv
from attention.ops.shard import Shard, received_positions
from attention.registry import Mixer
from attention.rope import apply_rope


class Attention(Mixer):
    pretrained_attention_shapes = True
    # whether attend() takes grouped-query k and v as they are (fewer heads than q): the kernels do, and SDPA and
    # FlexAttention never copy them; variants whose attend() assumes one k/v head per query head get them repeated
    native_gqa = False
    settings = ("attn_backend", "attn_gate", "n_kv_head", "attn_head_dim", "qk_norm", "qkv_bias")

    @classmethod
    def check_config(cls, config):
        if config.attn_backend not in BACKENDS:
            raise ValueError(f"attn_backend={config.attn_backend!r}: expected one of {', '.join(BACKENDS)}")

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.backend = config.attn_backend
        self.n_head, self.n_kv_head = config.n_head, config.kv_heads
        self.head_dim = config.head_dim
        inner, kv = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        self.split = (inner, kv, kv)
        self.c_attn = nn.Linear(config.n_embd, inner + 2 * kv, bias=config.bias or config.qkv_bias)
        # Qwen3's qk-norm: RMSNorm over each head's q and k, before RoPE
        self.q_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps) if config.qk_norm else None
        # gate of paper 000 (Alg. 2): y <- sigmoid(W y) * y, W d x d without bias, before the output projection
        self.gate = nn.Linear(inner, inner, bias=False) if config.attn_gate else None
        self.c_proj = nn.Linear(inner, config.n_embd, bias=config.bias)
        self.rope_theta = config.rope_theta if config.resolved_pos_embedding == "rope" else None
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.document_mask = config.document_mask  # its plans are made for calls with documents

    def forward(self, x, call: MixerCall):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, -1, self.head_dim) for t in self.c_attn(x).split(self.split, dim=2))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.rope_theta is not None:
            q, k = apply_rope(q, call.pos, self.rope_theta), apply_rope(k, call.pos, self.rope_theta)
        if not self.native_gqa:  # grouped-query: each k/v head serves n_head / n_kv_head consecutive query heads
            k, v = repeat_kv(q, k, v)
        return self.resid_dropout(self.c_proj(self.mix(q, k, v, call)))

    def mix(self, q, k, v, call: MixerCall):
        """Per-head q, k, v (B, H, T, D) -> the (B, T, C) input of the output projection: attention, heads
        merged, then the gate. Multi-path variants (sa_swa) override it to gate and sum their paths."""
        return gated(self.gate, merge_heads(self.attend(q, k, v, call)))

    def attend(self, q, k, v, call: MixerCall):
        """Per-head outputs (B, H, T, D). call.docs (B, T): where each token's document begins
        (attention/documents.py), given when the model masks documents (then no edge crosses from one document into
        another), else None."""
        raise NotImplementedError

    # why a layer that receives every other shard's keys does so (the start-up line under context parallelism)
    reaches_far = "its rule reaches every earlier key"

    def context_parallel_exchange(self, shard, bytes_per_element: int) -> str:
        """The most positions' keys and values any process of the group receives (context_parallel_received), their
        bytes, and whether that is every earlier position: the all-gather a rule that reaches far falls back to."""
        most = max(self.context_parallel_received(Shard(None, r, shard.size, shard.n)) for r in range(shard.size))
        heads = self.n_kv_head if self.native_gqa else self.n_head  # as the layer's attend() receives them
        size = most * 2 * heads * self.head_dim * bytes_per_element
        return (f"{most:,} positions' keys and values ({size / 2**20:.3g} MiB per sequence)"
                + (f": every position of the other shards, as much as all-gathering them ({self.reaches_far})"
                   if most and most >= shard.n - shard.length else ""))

    def pretrained_problem(self):
        """Attention with no parameters or state beyond a pretrained model's runs inside its attention."""
        if self.gate is not None or any(True for _ in self.buffers()):
            return own_state_problem(self)
        return ""

    def mixing_flops(self, seq_len):
        # QK^T and AV: 2 matmuls x 2 FLOPs per multiply-add, over the scores computed per query
        if not isinstance(self, EdgeCounts):
            return 0.0
        edges = sum(computed for computed, _ in self.edge_counts(seq_len))
        return 4 * self.head_dim * edges / seq_len

    def kernel_inputs(self, batch, seq_len, device, dtype, generator=None):
        # heads-first views of (B, n, H, D) projections, as the layer passes them (not contiguous copies); with
        # document_mask, packed documents of 200-3000 tokens too
        shape = (batch, seq_len, self.n_head, self.head_dim)
        qkv = tuple(torch.randn(shape, generator=generator, device=device, dtype=dtype).transpose(1, 2)
                    .detach().requires_grad_() for _ in range(3))
        return (*qkv, packed_document_starts(batch, seq_len, device=device)) if self.document_mask else qkv

    def kernel_forward(self, q, k, v, docs=None):
        """attend() at positions 0.. with the plan GPT.forward would make (sa draws its permutation here); docs as
        attend() takes them (a layer built with document_mask needs them)."""
        B, _, T, _ = q.shape
        return self.attend(q, k, v, MixerCall.at(T, q.device, self.plan(B, T, q.device), docs))


def context_parallel_refusal(layer) -> str:
    return (f"{type(layer).__name__} draws its edges afresh at every forward over the whole sequence: no "
            "context-parallel form yet (docs/context_parallel.md)")


def merge_heads(y):
    B, H, T, D = y.shape
    return y.transpose(1, 2).reshape(B, T, H * D)


def gated(gate, y):
    """Paper 000's attention gate sigmoid(W y) * y (no gate: y)."""
    return y if gate is None else torch.sigmoid(gate(y)) * y


class MaskedAttention(Attention):
    """Attention under one edge rule (self.rule), with softmax or another activation and an optional score_mod."""

    activation = "softmax"
    # every kernel masks documents from the rule: a variant that only names its rule masks them too
    takes_documents = True
    supports_cache = True
    native_gqa = True  # attend_planned and masked_attention take grouped-query k, v; the KV cache keeps n_kv_head
    context_parallel = True  # a shard receives the keys its rules reach on other shards (attend_shard)

    def __init__(self, config, layer_idx: int, rule: EdgeRule):
        super().__init__(config, layer_idx)
        self.rule = rule

    def score_mod(self, device):
        """FlexAttention-style score_mod(score, b, h, q_idx, kv_idx) for tensors on device, or None (see
        attention/ops/score_mod.py). Return the same function object at every call: compiled flex recompiles for a
        new one."""
        return None

    def compile_key(self):
        return (type(self).__name__, self.paths(), self.activation)

    def paths(self) -> tuple:
        """The rules of the separately normalised paths whose outputs are summed (one rule: attention)."""
        return (self.rule,)

    def plan(self, batch_size, seq_len, device, start: int = 0):
        """One AttentionPlan per path (attention/kernels.py): its masks, built once per length and rule."""
        return tuple(plan_attention(rule, self.backend, seq_len, self.n_head, self.head_dim, device, start,
                                    score_mod=self.score_mod(device), activation=self.activation,
                                    documents=self.document_mask)
                     for rule in self.paths())

    def attend(self, q, k, v, call: MixerCall):
        """The sum of attention under each of the paths' rules, each normalised on its own."""
        dropout_p = self.dropout if self.training else 0.0
        if call.shard is not None:
            return self.attend_shard(q, k, v, call.shard, dropout_p)
        cache, pos = call.cache, call.pos
        if cache is None or (cache.empty and q.shape[2] > 1):  # training, or a prompt's first pass (from 0)
            plan = call.plan or self.plan(q.shape[0], q.shape[2], q.device, 0 if cache is None else int(pos[0]))
            y = attend_paths(q, k, v, plan, dropout_p, call.docs)
            if cache is not None:
                cache.update(k, v, pos)
            return y
        keys, values, key_pos = cache.update(k, v, pos)
        return self.attend_cached(q, keys, values, pos, key_pos, call.docs)

    def key_span(self, shard, rank: int) -> tuple[int, int]:
        """The positions [lo, hi) that the queries of shard `rank` and their keys span: its own and every key its
        paths' rules may reach from it (key_ranges), within the sequence."""
        q_lo, q_hi = shard.bounds(rank)
        ranges = [r for rule in self.paths() for r in rule.key_ranges(q_lo, q_hi)]
        return max(0, min([q_lo] + [lo for lo, _ in ranges])), min(shard.n, max([q_hi] + [hi for _, hi in ranges]))

    def attend_shard(self, q, k, v, shard, dropout_p: float):
        """A shard's queries (context parallelism) over the keys its rules reach: the keys and values of
        key_span, received from the processes that hold them, run through the same kernels as one process runs
        the stretch at its own positions (queries of other shards' positions zero, their rows dropped), so no
        kernel knows of shards. A window's shard receives its w - 1 keys before it; a rule that reaches every
        earlier key receives all of them (docs/context_parallel.md)."""
        if not all(rule.static for rule in self.paths()):
            raise ValueError(context_parallel_refusal(self))
        lo, hi = self.key_span(shard, shard.rank)
        s, e = shard.bounds()
        kv = shard.gather_range(torch.stack([k, v]), lambda r: self.key_span(shard, r), 3, "keys and values")
        q = F.pad(q, (0, 0, s - lo, hi - e))
        plan = self.shard_plan(q.shape[0], hi - lo, q.device, lo)
        docs = None if shard.docs is None else shard.docs[:, lo:hi]
        return attend_paths(q, kv[0], kv[1], plan, dropout_p, docs)[:, :, s - lo:e - lo]

    def context_parallel_received(self, shard) -> int:
        """The positions whose keys and values this process receives per layer: key_span's, on other shards (the
        plan gather_range follows)."""
        return received_positions(shard, lambda r: self.key_span(shard, r))

    @torch.compiler.disable  # planning runs outside compiled code (GPT.plan does the same for whole sequences)
    def shard_plan(self, batch_size, n, device, start):
        return self.plan(batch_size, n, device, start)

    def context_parallel_problem(self) -> str:
        return "" if all(rule.static for rule in self.paths()) else context_parallel_refusal(self)

    def attend_cached(self, q, keys, values, pos, key_pos, docs=None):
        """New queries at positions pos over cached keys at key_pos (-1: an empty slot): generation's step, here
        and inside a pretrained model (attention/hf.py); docs (B, T) of the new queries: the keys of earlier
        documents are left out."""
        valid = (key_pos >= 0) if docs is None else keys_in_document(docs, key_pos)
        return sum(masked_attention(q, keys, values, rule.dense_mask(pos, key_pos, self.n_head) & valid,
                                    pos, key_pos, self.score_mod(q.device), self.activation) for rule in self.paths())

    @property
    def translation_invariant(self) -> bool:
        """Derived from the rules: every path's edges depend on q - k alone."""
        return all(rule.translation_invariant(self.n_head) for rule in self.paths())

    def edge_rule(self) -> EdgeRule:
        """Every edge of the layer as one rule (the union of its paths): for coverage and reachability."""
        paths = self.paths()
        return paths[0] if len(paths) == 1 else AnyOf(paths)

    def head_windows(self):
        return self.rule.head_windows(self.n_head)

    def init_cache(self, batch_size, max_len, device, dtype):
        lookback = self.rule.lookback
        size = max_len if lookback is None else min(max_len, lookback + 1)
        cache_type = KVCache if lookback is None else RollingKVCache
        heads = self.n_kv_head if self.native_gqa else self.n_head
        return cache_type((batch_size, heads, size, self.head_dim), device, dtype)

    def edge_counts(self, seq_len):
        heads = range(self.n_head) if self.rule.per_head else [0] * self.n_head
        return [(self.rule.count_edges(seq_len, h),) * 2 for h in heads]  # one branch: computed == allowed

    def edge_mask(self, seq_len, device="cpu"):
        mask = self.rule.dense_mask(torch.arange(seq_len, device=device), n_head=self.n_head)
        return mask.any(0) if self.rule.per_head else mask

    def saved_activations(self, config, kernels, B, T):
        # derived from the rules and kernels: a new variant under edge rules has its estimate for free
        return attention_saved(self, config, kernels, B, T)
