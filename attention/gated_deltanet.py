"""Gated DeltaNet (Yang, Kautz, Hatamizadeh 2025), the recurrent layer of paper 003's SWAX/GDN hybrids.

Per head, with unit-norm keys k_t, queries q_t (unit norm, scaled by 1/sqrt(d)), values v_t, a write strength
beta_t = sigmoid(W_b x_t) in (0, 1) and a log decay g_t = -exp(A_log) softplus(W_a x_t + dt_offset) <= 0, the
state S (d_k x d_v, zero at the start) follows the gated delta rule
    S_t = exp(g_t) (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t,      o_t = q_t S_t
(rows are vectors): decay the memory, then move what it recalls for k_t a fraction beta_t of the way towards
v_t. q, k, v each pass a short causal depthwise convolution and SiLU first; the read is RMS-normalised per head
and gated by SiLU(W_g x). The rule is the recurrence core's delta rule (attention/ops/recurrence: log decay g,
strength beta), in its forms, equal to float tolerance (tests):
    chunked     training, O(n): the WY form (attention/ops/recurrence/chunk.py, which derives it), exact within
                chunks of gdn_chunk tokens, the state between them
    step        generation: one token at a time, constant memory (and the parallel reference in the tests)
    fla         fla's Triton chunk kernel (the same chunked algorithm; fla_kernel.py): gdn_kernel=auto uses it for
                bf16/fp16 activations on CUDA when the package is installed, gdn_kernel=fla on any CUDA input; on
                the CPU standing in for CUDA (attention/simulate_cuda.py) its stand-in, fla_chunk_stand_in
The short convolutions are conv.py's causal_conv. With packed documents (docs, attention/documents.py) every
document starts from a zero state and its first tokens' convolutions read none of the previous document's
inputs: exactly in the native forms, and in fla's kernel (which takes no documents but as cu_seqlens, built on
the host) by a decay of RESTART_LOG_DECAY at a document's first token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attention import simulate_cuda
from attention.documents import begins_document
from attention.memory import F32, linear_inputs, padded
from attention.ops.gated_deltanet.conv import causal_conv
from attention.ops.gated_deltanet.fla_kernel import fla_chunk_kernel, fla_chunk_stand_in
from attention.ops.recurrence import FORMS, Gates, State, recurrence
from attention.ops.recurrence.memory import chunked_saved
from attention.call import MixerCall
from attention.registry import RecurrentMixer, Setting, chunk_loop_problem, register

GDN_CHUNK = Setting("gdn_chunk", int, 64, "gated_deltanet: chunk length of the chunked (WY) training form")
GDN_CONV_SIZE = Setting("gdn_conv_size", int, 4, "gated_deltanet: width of the short causal convolutions on q, k, v")
GDN_KERNEL = Setting("gdn_kernel", str, "auto", "gated_deltanet: auto (fla's chunk kernel for bf16/fp16 on CUDA when "
                     "installed) | native | fla")

KERNELS = ("auto", "native", "fla")
# fla's kernel takes packed documents only as cu_seqlens, whose chunk indices it builds on the host (a
# synchronisation): the log decay at a document's first token is set to this instead, which keeps exp(-30) ~ 1e-13
# of the state before it. Finite, as the kernel takes differences of cumulative decays, which -inf would make
# NaN; and no larger than it needs to be, as their float32 rounding grows with it (outputs within 1e-5 of the
# exact form's). The native forms restart exactly
RESTART_LOG_DECAY = -30.0


@dataclass
class GDNState:
    """Generation state of a Gated DeltaNet layer: the delta-rule state S (B, H, d, D) and the convolution states
    (the last gdn_conv_size - 1 inputs of the q, k and v convolutions), or None before the first token."""

    state: torch.Tensor | None = None
    conv: tuple | None = None

    @property
    def empty(self) -> bool:
        return self.state is None


@register("gated_deltanet")
class GatedDeltaNet(RecurrentMixer):
    paper = "003"
    summary = "every j <= i, through the gated delta rule's state"
    settings = (GDN_CHUNK, GDN_CONV_SIZE, GDN_KERNEL)
    forms = FORMS
    takes_documents = True  # every form restarts the state at a document's first token
    context_parallel = True  # the core starts each shard from the state its earlier shards leave, its convolutions
    #                          from the inputs before it
    translation_invariant = True  # a state from zero at a document's start, RoPE's relative positions
    gpu_kernel = ("gdn_kernel", "fla", "flash-linear-attention", "kernel fla")

    def kernel_inputs(self, batch, seq_len, device, dtype, generator=None):
        """q, k, v (B, H, n, D) and the decay and beta pre-activations (B, H, n)."""
        def randn(*shape, scale=1.0, shift=0.0, type_=dtype):
            return (torch.randn(shape, generator=generator, device=device, dtype=type_) * scale + shift)
        shape = (batch, self.n_head, seq_len, self.head_dim)
        q, k, v = randn(*shape), randn(*shape), randn(*shape)
        g = randn(batch, self.n_head, seq_len, scale=0.5, shift=-3.0, type_=torch.float32)
        beta = randn(batch, self.n_head, seq_len, type_=torch.float32)
        return tuple(t.requires_grad_() for t in (q, k, v, g, beta))

    def kernel_forward(self, q, k, v, g, beta):
        """The recurrence as the layer runs it: fla's chunk kernel where the layer would use it, else the built-in
        chunked form (normalised q and k, float32 state)."""
        decay, beta = -F.softplus(-g), torch.sigmoid(beta)
        fla = self.fla_kernel_for(q.device, q.dtype)
        if fla is not None:  # (B, T, H, D) layout; the kernel normalises q and k itself
            layout = lambda t: t.transpose(1, 2).contiguous()  # noqa: E731
            y, _ = fla(layout(q), layout(k), layout(v), layout(decay), layout(beta.to(v.dtype)),
                       scale=self.head_dim ** -0.5, use_qk_l2norm_in_kernel=True)
            return y.transpose(1, 2)
        q, k = (F.normalize(t.float(), dim=-1, eps=1e-6) for t in (q, k))
        return self.delta_rule(q * self.head_dim ** -0.5, k, v.float(), decay, beta)[0]

    def delta_rule(self, q, k, v, g, beta, state=None, starts=None, form=None, shard=None):
        """The core's delta rule over q (normalised and scaled), k (normalised), v (B, H, n, D) with log decay g
        and strength beta (B, H, n), from state S (None: zero), in the recurrence's form (None: the layer's,
        chunked unless set otherwise): the reads and the state S after the last token."""
        state = None if state is None else State(state)
        y, _, final = recurrence(form or self.form, q, k, v, Gates(log_decay=g, beta=beta), state, starts,
                                 chunk=self.chunk, shard=shard)
        return y, final.S

    def expected_graph_breaks(self, device, dtype):
        return "fla's chunk kernel is torch.compiler.disable'd by fla" if self.fla_kernel_for(device, dtype) else ""

    @classmethod
    def check_config(cls, config):
        if config.gdn_chunk < 1:
            raise ValueError(f"gdn_chunk={config.gdn_chunk}: must be >= 1 (64 is the usual chunk length)")
        if config.gdn_conv_size < 1:
            raise ValueError(f"gdn_conv_size={config.gdn_conv_size}: must be >= 1 (1 is a per-channel scale, "
                             "4 the usual short convolution)")
        if config.gdn_kernel not in KERNELS:
            raise ValueError(f"gdn_kernel={config.gdn_kernel!r}: expected one of {', '.join(map(repr, KERNELS))}")

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.chunk, self.conv_size, self.kernel = config.gdn_chunk, config.gdn_conv_size, config.gdn_kernel
        self.norm_eps = config.norm_eps
        # fla's kernel (None when not installed), looked up once here: compiled forwards read it, not a trace of
        # the cached lookup (torch.compile re-runs a functools.cache'd function's body)
        self.fla = fla_chunk_kernel() if self.kernel != "native" else None
        if self.kernel == "fla" and self.fla is None and not simulate_cuda.stand_ins():
            raise ImportError("gdn_kernel=fla needs the flash-linear-attention package (pip install -r "
                              "requirements-gpu.txt); gdn_kernel=auto or native use the built-in chunked form")
        C = config.n_embd
        self.c_q = nn.Linear(C, C, bias=config.bias)
        self.c_k = nn.Linear(C, C, bias=config.bias)
        self.c_v = nn.Linear(C, C, bias=config.bias)
        self.q_conv = nn.Conv1d(C, C, self.conv_size, groups=C, bias=False)
        self.k_conv = nn.Conv1d(C, C, self.conv_size, groups=C, bias=False)
        self.v_conv = nn.Conv1d(C, C, self.conv_size, groups=C, bias=False)
        self.c_beta = nn.Linear(C, self.n_head, bias=False)
        self.c_decay = nn.Linear(C, self.n_head, bias=False)
        # names that do not end in "bias": the model's generic init zeroes those, and these are set below
        self.A_log = nn.Parameter(torch.zeros(self.n_head))
        self.dt_offset = nn.Parameter(torch.zeros(self.n_head))
        self.c_gate = nn.Linear(C, C, bias=config.bias)
        self.o_norm_weight = nn.Parameter(torch.ones(self.head_dim))
        self.c_proj = nn.Linear(C, C, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """fla's Mamba2-style decay init: A ~ U(0, 16), step dt log-uniform in [1e-3, 1e-1] (floor 1e-4), with
        dt_offset = softplus^-1(dt), so each head starts with its own memory time scale. The short convolutions
        keep PyTorch's Conv1d init (uniform +-1/sqrt(width)), as in fla, not the model's N(0, 0.02) for matrices:
        with that, q, k, v would start about 25x too small."""
        if self.A_log.device.type == "meta":
            return
        for conv in (self.q_conv, self.k_conv, self.v_conv):
            conv.reset_parameters()
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0, 16).log())
        dt = torch.empty_like(self.dt_offset).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp(min=1e-4)
        self.dt_offset.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.o_norm_weight.fill_(1.0)

    def fla_kernel(self, x):
        """fla's chunk kernel when it should run on x, else None."""
        return self.fla_kernel_for(x.device, x.dtype)

    def fla_kernel_for(self, device, dtype):
        if self.kernel == "native" or not simulate_cuda.gpu_path(device):
            return None  # fla's kernels are Triton (CUDA) only
        if self.kernel == "auto" and dtype not in (torch.bfloat16, torch.float16):
            return None  # some fla versions reject float32 inputs; full precision runs use the native form
        return fla_chunk_stand_in if simulate_cuda.simulated(device) else self.fla

    def resolved_settings(self, seq_len, device, dtype):
        return {"gdn_kernel": "fla" if self.fla_kernel_for(device, dtype) is not None else "native"}

    def compile_problem(self, seq_len, device, dtype):
        if self.fla_kernel_for(device, dtype) is not None:
            return ""  # fla's chunk kernel (fla keeps it out of compiled graphs itself: one graph break)
        return chunk_loop_problem("gated_deltanet", seq_len, self.chunk, "install flash-linear-attention on the "
                                  "CUDA machine (pip install -r requirements-gpu.txt) and train in bfloat16 for "
                                  "fla's chunk kernel")

    def forward(self, x, call: MixerCall):
        B, T, C = x.shape
        pos, cache, docs = call.pos, call.cache, call.docs
        H, D = self.n_head, self.head_dim
        conv = (None, None, None) if cache is None or cache.conv is None else cache.conv
        reach = None if docs is None else pos - docs  # the earlier tokens of each token's document
        starts = None if docs is None else begins_document(docs, pos)
        projected = self.c_q(x), self.c_k(x), self.c_v(x)
        if call.shard is not None:  # the convolutions continue from the last inputs of the shard before
            conv = conv_halos(call.shard, projected, self.conv_size)
        q, q_state = causal_conv(projected[0], self.q_conv.weight, conv[0], reach)
        k, k_state = causal_conv(projected[1], self.k_conv.weight, conv[1], reach)
        v, v_state = causal_conv(projected[2], self.v_conv.weight, conv[2], reach)
        q, k, v = (F.silu(t).view(B, T, H, D) for t in (q, k, v))
        # the state sums many decayed terms: keep the recurrence in float32 or better under autocast
        compute = torch.promote_types(v.dtype, torch.float32)
        beta_logit = self.c_beta(x).to(compute)  # (B, T, H)
        decay_logit = self.c_decay(x).to(compute) + self.dt_offset.to(compute)
        previous = None if cache is None else cache.state

        kernel = None if cache is not None and T == 1 or call.shard is not None else self.fla_kernel(v)
        if kernel is not None:
            beta = torch.sigmoid(beta_logit)
            g = -self.A_log.to(compute).exp() * F.softplus(decay_logit)
            if starts is not None:  # fla's kernel takes no document starts: its decay forgets the state there
                forgets = starts if previous is not None else starts & (torch.arange(T, device=x.device) > 0)
                g = torch.where(forgets[..., None], RESTART_LOG_DECAY, g)
            y, state = kernel(q, k, v, g, beta.to(v.dtype), scale=D ** -0.5, initial_state=previous,
                              output_final_state=cache is not None, use_qk_l2norm_in_kernel=True)
            y = y.to(compute)
        else:
            q = F.normalize(q.to(compute), dim=-1, eps=1e-6) * D ** -0.5
            k = F.normalize(k.to(compute), dim=-1, eps=1e-6)
            q, k, v32 = (t.transpose(1, 2) for t in (q, k, v.to(compute)))
            # gates made per head (B, H, T), contiguous, before their nonlinearities: on strided gates a compiled
            # backward (aot_eager) assumes other strides than eager gives, and fails to view the gradient
            beta = torch.sigmoid(beta_logit.transpose(1, 2).contiguous())
            g = -self.A_log.to(compute).exp()[:, None] * F.softplus(decay_logit.transpose(1, 2).contiguous())
            # autocast would run the products with the state (and build A) in bf16 again
            with torch.autocast(x.device.type, enabled=False):
                y, state = self.delta_rule(q, k, v32, g, beta, previous, starts,
                                           "step" if cache is not None and T == 1 else None, call.shard)
            y = y.transpose(1, 2)
        if cache is not None:
            cache.state = state.to(compute)
            cache.conv = (q_state, k_state, v_state)

        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.o_norm_weight.to(compute)
        y = y * F.silu(self.c_gate(x)).view(B, T, H, D).to(compute)
        y = y.to(v.dtype).reshape(B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def init_cache(self, batch_size, max_len, device, dtype):
        return GDNState()

    def mixing_flops(self, seq_len):
        chunk = min(self.chunk, seq_len)
        d = self.head_dim
        # per token and head: k k^T and q k^T over half a chunk, the triangular solve for u and w, the
        # intra-chunk read; then w S, q S and the state update, each a d x d product
        within = 2 * chunk / 2 * (d + d + 2 * d + d)
        across = 3 * 2 * d * d
        convolutions = 3 * 2 * self.conv_size * self.head_dim
        return self.n_head * (within + across + convolutions)

    def describe(self):
        if self.kernel == "auto":
            if simulate_cuda.active():
                kernel = "kernel fla for bf16/fp16 on CUDA (its CPU stand-in while simulating CUDA), else native"
            elif fla_chunk_kernel() is not None:
                kernel = "kernel fla for bf16/fp16 on CUDA, else native"
            else:
                kernel = "kernel native (fla not installed)"
        else:
            kernel = f"kernel {self.kernel}"
        return f"Gated DeltaNet: head dim {self.head_dim}, chunk {self.chunk}, conv {self.conv_size}, {kernel}"

    def saved_activations(self, m, k, B: int, T: int):
        """Gated DeltaNet (attention/gated_deltanet.py). Shared by both forms, per token (a, C, H as in mlstm_saved):

            linear inputs        c_q, c_k, c_v, c_gate, c_beta, c_decay: 6 a C under autocast, else 4 C
            short convolutions   per q, k, v: the zero-padded input (a C (T + K - 1) / T) and the output (silu's
                                 input, a C): 6 a C
            beta, decay          float32 per head: sigmoid's output, softplus's input and output (12 H)
            output norm, gate    the float32 read y (4 C), y / rms (4 C), its weighted form (4 C), 1/rms (4 H),
                                 c_gate's output (silu's input, a C), silu of it in float32 (4 C), and the
                                 product in the activation dtype (c_proj's input, a C)

        Form fla (CUDA, bf16): l2-normalised q and k (2 a C) with their 1/norm (8 H), v (a C), beta (a H), the
        chunk-cumulated decay (4 H) and the inverted chunk matrix A (64 per head and position, activation bytes).
        Form native (float32): normalize's input for q and k (8 C) and its statistics, v in float32 (4 C), then per
        position and head, with head dim D, what the recurrence core's chunked delta rule keeps
        (attention/ops/recurrence/memory.py) and the normalised q and k before the layer scales and transposes
        them (2 D)."""
        C, H, D, a, tokens = m.n_embd, m.n_head, m.head_dim, k.act, B * T
        K = self.conv_size
        saved = {"linear inputs": tokens * linear_inputs(k, 6, C),
                 "short convolutions (inputs and outputs)": 3 * a * B * C * (T + K - 1) + 3 * a * tokens * C,
                 "beta and decay (fp32)": 3 * F32 * tokens * H}
        fla = k.device == "cuda" and self.kernel != "native" and (k.autocast or self.kernel == "fla")
        if fla:
            saved["fla: normalised q, k, their norms, v, beta, decay"] = tokens * (3 * a * C + 2 * F32 * H + a * H + F32 * H)
            saved["fla: inverted chunk matrix A"] = a * tokens * H * 64
            matmuls = 0
        else:
            L = self.chunk
            n = padded(T, L)
            saved["normalize inputs for q, k and v in fp32"] = F32 * tokens * (3 * C + 4 * H)
            per_head = chunked_saved(L, D, D, decay=True, delta=True) + 2 * D - 1
            saved["chunked delta rule (fp32)"] = int(F32 * B * H * n * per_head)
            matmuls = int(F32 * B * H * n * (2 * L + 3 * D + D * D / L))
        saved["output norm and gate"] = tokens * (4 * F32 * C + F32 * H + 2 * a * C)
        linear_outputs = a * tokens * (5 * C + 2 * H)  # c_q, c_k, c_v, c_gate, c_proj; beta, decay
        return saved, matmuls + linear_outputs


def conv_halos(shard, projected, width: int) -> tuple:
    """Each short convolution's state at a shard's start under context parallelism: the width - 1 inputs before
    it, received from the shards that hold them (zeros before the sequence), as causal_conv takes a state
    (B, C, width - 1). The inputs of the three convolutions travel as one exchange."""
    if width == 1:
        return (None, None, None)
    inputs = torch.cat(projected, -1)  # (B, T, 3C)
    halo = shard.gather_range(inputs, lambda r: (shard.bounds(r)[0] - width + 1, shard.bounds(r)[0]), 1,
                              "convolution halo")
    return tuple(part.transpose(1, 2) for part in halo.split(projected[0].shape[-1], -1))

