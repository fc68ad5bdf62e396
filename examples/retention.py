"""retention: RetNet's multi-scale retention (Sun et al. 2023) as one file on the recurrence core.

Per head h a fixed decay gamma_h = 1 - 2^(-5 - h), so head h's state S_t = gamma_h S_{t-1} + k_t^T v_t and its
read q_t S_t weigh key j by gamma_h^(t - j): the core's recurrence with a constant log decay and no other gate
(attention/ops/recurrence). q and k are rotated by RoPE at the tokens' positions, the read is normalised per head
(GroupNorm) and gated by SiLU(W_g x), as in RetNet. The core gives it its three forms (chunked for training, one
step at a time for generation, the parallel reference), packed documents and the state generation keeps; what is
written here is the gates, the projections, the settings and its byte model. Dropped into attention/, every tool
and the conformance kit (tests/models/test_conformance.py) reach it with nothing else edited."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from attention.documents import begins_document
from attention.memory import F32, linear_inputs, padded, rope_tables
from attention.ops.recurrence import FORMS, Gates, recurrence
from attention.ops.recurrence.memory import chunked_saved
from attention.registry import RecurrentMixer, Setting, at_least, register
from attention.rope import apply_rope

RETENTION_CHUNK = Setting("retention_chunk", int, 64, "retention: chunk length of the chunked training form",
                          check=at_least(1))


@register("retention")
class MultiScaleRetention(RecurrentMixer):
    paper = "RetNet (Sun et al. 2023)"
    summary = "every j <= i, weighted gamma_h^(i - j) with a fixed decay per head (RetNet's multi-scale retention)"
    settings = (RETENTION_CHUNK,)
    forms = FORMS
    takes_documents = True  # the core restarts the state at each document's first token
    context_parallel = True  # the core starts a shard from the state its earlier shards leave (call.shard)
    translation_invariant = True  # a state from zero at a document's start, RoPE's relative positions

    def __init__(self, config, layer_idx):
        super().__init__()
        self.n_head, self.head_dim, self.chunk = config.n_head, config.head_dim, config.retention_chunk
        C = config.n_embd
        self.c_qkv = nn.Linear(C, 3 * C, bias=False)
        self.c_gate = nn.Linear(C, C, bias=False)
        self.c_proj = nn.Linear(C, C, bias=False)
        self.rope_theta = config.rope_theta if config.resolved_pos_embedding == "rope" else None
        self.log_gamma = [math.log(1 - 2.0 ** (-5 - h)) for h in range(self.n_head)]

    def forward(self, x, call):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in self.c_qkv(x).split(C, dim=2))
        if self.rope_theta is not None:
            q, k = apply_rope(q, call.pos, self.rope_theta), apply_rope(k, call.pos, self.rope_theta)
        compute = torch.promote_types(q.dtype, torch.float32)  # the state sums many terms: float32 or better
        decay = torch.tensor(self.log_gamma, dtype=compute, device=x.device)[None, :, None].expand(B, -1, T)
        starts = None if call.docs is None else begins_document(call.docs, call.pos)
        state = None if call.cache is None else call.cache.state
        form = "step" if call.cache is not None and T == 1 else self.form
        y, _, state = recurrence(form, q.to(compute) * self.head_dim ** -0.5, k.to(compute), v.to(compute),
                                 Gates(log_decay=decay), state, starts, chunk=self.chunk, shard=call.shard)
        if call.cache is not None:
            call.cache.state = state
        y = F.group_norm(y.transpose(1, 2).reshape(B * T, C), self.n_head).view(B, T, C)
        return self.c_proj(F.silu(self.c_gate(x)) * y.to(x.dtype))

    @classmethod
    def example_settings(cls, window):
        return {"retention_chunk": max(8, window // 2)}

    def describe(self):
        return f"retention: {self.n_head} heads, decays 1 - 2^-5 .. 1 - 2^-{4 + self.n_head}, chunk {self.chunk}"

    def saved_activations(self, m, k, B, T):
        """Per token: c_qkv's and c_gate's inputs, RoPE's tables; per position and head, what the core's chunked
        form keeps with a constant decay (q, k and v in float32 among it; attention/ops/recurrence/memory.py); the
        group norm's float32 input and statistics, c_gate's output, its silu, the normalised read and their
        product (c_proj's input)."""
        C, H, D, a, tokens = m.n_embd, self.n_head, self.head_dim, k.act, B * T
        n = padded(T, self.chunk)
        core = chunked_saved(self.chunk, D, D, decay=True, learned=False)
        saved = {"linear inputs": tokens * linear_inputs(k, 2, C), "recurrence (fp32)": int(F32 * B * H * n * core)}
        if self.rope_theta is not None:
            saved["RoPE cos/sin tables"] = rope_tables(T, D)
        saved["group norm input and statistics (fp32)"] = F32 * tokens * (C + 2 * H)
        saved["gate, its silu, the normalised read and their product"] = 4 * a * tokens * C
        return saved, a * tokens * 4 * C
