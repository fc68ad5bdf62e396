"""Linear attention with the 2nd-order Taylor feature map (paper 002 Sec. 4.4 and App. B.2.1, after Based).

Per head, q and k are projected to `linear_feature_dim` (16) dimensions and rotated by RoPE; the feature map
    phi(x) = [1, x / d^(1/4), vec(x x^T) / (sqrt(2) sqrt(d))]        (d = feature dim)
gives phi(q) . phi(k) = 1 + t + t^2 / 2 with t = q . k / sqrt(d), the Taylor expansion of exp(t), which is
at least 1/2, so the normalised read o_i = phi(q_i) S_i / (phi(q_i) z_i), with S_i = sum_{j<=i} phi(k_j)^T v_j
and z_i = sum_{j<=i} phi(k_j), never divides by zero. It is the recurrence core (attention/ops/recurrence) with
the Taylor feature map (attention/ops/linear/feature_map.py: TAYLOR) and no gates; z is the state's column for a
column of ones appended to v. The core's forms: chunked for training and prompts, one step at a time for
generation (and its parallel reference in the tests); with packed documents (docs, attention/documents.py) every
document's first token starts from a zero state.
"""

from __future__ import annotations

import torch
from torch import nn

from attention.documents import begins_document
from attention.memory import F32, linear_inputs, padded, rope_tables
from attention.ops.linear.feature_map import TAYLOR
from attention.ops.recurrence import FORMS, Gates, recurrence
from attention.ops.recurrence.memory import chunked_saved
from attention.call import MixerCall
from attention.registry import RecurrentMixer, Setting, register
from attention.rope import apply_rope

LINEAR_FEATURE_DIM = Setting("linear_feature_dim", int, 16, "linear: q/k feature dimension of Taylor linear attention "
                             "(paper 002)")
LINEAR_CHUNK = Setting("linear_chunk", int, 64, "linear: chunk length of the chunked training form")


@register("linear")
class TaylorLinearAttention(RecurrentMixer):
    paper = "002"
    summary = "every j <= i, through a Taylor-feature linear attention state (no softmax)"
    settings = (LINEAR_FEATURE_DIM, LINEAR_CHUNK)
    forms = FORMS
    takes_documents = True  # every form restarts the state at a document's first token
    context_parallel = True  # the core starts each shard from the state its earlier shards leave
    translation_invariant = True  # a state from zero at a document's start, RoPE's relative positions

    def kernel_inputs(self, batch, seq_len, device, dtype, generator=None):
        """q, k (B, H, n, feature_dim) and v (B, H, n, D)."""
        def randn(*shape):
            return torch.randn(shape, generator=generator, device=device, dtype=dtype).requires_grad_()
        return (randn(batch, self.n_head, seq_len, self.feature_dim),
                randn(batch, self.n_head, seq_len, self.feature_dim), randn(batch, self.n_head, seq_len, self.head_dim))

    def kernel_forward(self, q, k, v):
        compute = torch.promote_types(q.dtype, torch.float32)
        return self.attend(q.to(compute), k.to(compute), v.to(compute))[0]

    def attend(self, q, k, v, state=None, starts=None, form=None, shard=None):
        """Normalised reads of q, k (B, H, n, f) and v (B, H, n, D) from state (None: zero; under context
        parallelism, shard: the state the earlier shards leave), in the recurrence's form (None: the layer's,
        chunked unless set otherwise), and the state after the last token."""
        ones = torch.ones_like(v[..., :1])  # the normaliser z: the state's column for a column of ones
        reads, _, state = recurrence(form or self.form, q, k, torch.cat([v, ones], -1), Gates(), state, starts,
                                     TAYLOR, self.chunk, shard)
        return reads[..., :-1] / reads[..., -1:], state

    @classmethod
    def check_config(cls, config):
        if config.linear_feature_dim < 2 or config.linear_feature_dim % 2:
            raise ValueError(f"linear_feature_dim={config.linear_feature_dim}: must be even (RoPE) and >= 2")
        if config.linear_chunk < 1:
            raise ValueError(f"linear_chunk={config.linear_chunk}: must be >= 1")

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.n_head, self.head_dim, self.feature_dim = config.n_head, config.head_dim, config.linear_feature_dim
        self.chunk = config.linear_chunk
        self.c_qk = nn.Linear(config.n_embd, 2 * config.n_head * self.feature_dim, bias=config.bias)
        self.c_v = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.rope_theta = config.rope_theta if config.resolved_pos_embedding == "rope" else None
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, call: MixerCall):
        B, T, C = x.shape
        pos, cache, docs = call.pos, call.cache, call.docs
        starts = None if docs is None else begins_document(docs, pos)
        q, k = (t.view(B, T, self.n_head, self.feature_dim).transpose(1, 2)
                for t in self.c_qk(x).split(self.n_head * self.feature_dim, dim=2))
        v = self.c_v(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        if self.rope_theta is not None:
            q, k = apply_rope(q, pos, self.rope_theta), apply_rope(k, pos, self.rope_theta)
        # the state sums many terms: float32 or better, also under autocast (the core turns it off)
        compute = torch.promote_types(q.dtype, torch.float32)
        q, k, v32 = q.to(compute), k.to(compute), v.to(compute)
        previous = None if cache is None else cache.state
        y, state = self.attend(q, k, v32, previous, starts, "step" if cache is not None and T == 1 else None,
                               call.shard)
        if cache is not None:
            cache.state = state
        y = y.to(v.dtype).transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def mixing_flops(self, seq_len):
        features = 1 + self.feature_dim + self.feature_dim ** 2
        within = 2 * self.chunk / 2 * (self.feature_dim + self.head_dim)  # intra-chunk kernel and read
        across = 2 * 2 * features * self.head_dim  # state update and read
        return self.n_head * 2 * (within + across)

    def describe(self):
        return f"Taylor linear attention, feature dim {self.feature_dim} ({1 + self.feature_dim + self.feature_dim ** 2} features)"

    def saved_activations(self, m, k, B: int, T: int):
        """Taylor linear attention (attention/linear.py), its chunked form. Per token: the inputs of c_qk and c_v
        (2 a C under autocast, else 4 C), RoPE's tables over the feature dimension f, the merged output (c_proj's
        input, a C). Per position and head, in float32 also under autocast (the recurrence core turns it off): what
        the core's chunked form keeps with the Taylor map over v with its column of ones (D + 1 values;
        attention/ops/recurrence/memory.py), and the reads the normalisation divides (D + 1)."""
        C, H, D, a, tokens = m.n_embd, m.n_head, m.head_dim, k.act, B * T
        f, L = self.feature_dim, self.chunk
        Fdim, n = 1 + f + f * f, padded(T, L)
        saved = {"linear inputs": tokens * linear_inputs(k, 2, C)}
        if self.rope_theta is not None:
            saved["RoPE cos/sin tables"] = rope_tables(T, f)
        per_head = chunked_saved(L, f, D + 1, features=TAYLOR) + (D + 1)
        saved["chunked form (fp32)"] = int(F32 * B * H * n * per_head)
        saved["merged output"] = a * tokens * C
        matmuls = int(F32 * B * H * n * (L + 2 * (D + 1) + Fdim * (D + 1) / L)) + a * tokens * (2 * H * f + 2 * C)
        return saved, matmuls
