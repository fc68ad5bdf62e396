"""The mLSTM layer of xLSTM 7B (Beck et al. 2025), the recurrent mixer of SWAX (paper 003).

Per head (H = mlstm_n_head, 8 by default as in xLSTM 7B, independent of the attention layers' n_head), with
q, k of width d_qk (= mlstm_qk_dim_factor * n_embd / H) and v of width d_v (= n_embd / H), an exponential input gate i_t and a sigmoid forget gate f_t (pre-activations, soft-capped to +-15) and a
stabiliser m (m_0 = 0) that keeps every exponent <= 0:

    m_t = max(log sigmoid(f_t) + m_{t-1}, i_t)
    C_t = exp(log sigmoid(f_t) + m_{t-1} - m_t) C_{t-1} + exp(i_t - m_t) k_t v_t^T      (d_qk x d_v)
    n_t = exp(log sigmoid(f_t) + m_{t-1} - m_t) n_{t-1} + exp(i_t - m_t) k_t
    h_t = C_t^T q~_t / (max(|n_t . q~_t|, exp(-m_t)) + eps),   q~ = q / sqrt(d_qk)

then a LayerNorm per head, the output gate sigmoid(W_o x) and the output projection. C and n are stored
divided by exp(m_t); the denominator's exp(-m_t) is the stabilised form of max(|n . q|, 1).

The cell is the recurrence core's stabilised recurrence (attention/ops/recurrence) with log decay log sigmoid(f),
log write weight i and n as the state's column for a column of ones appended to v (attention/ops/mlstm/cell.py),
in the core's three forms, equal to float tolerance (tests, which also compare with `mlstm_kernels`' own sequence
kernel): chunked for training and prompts (chunks of mlstm_chunk tokens), one step at a time for generation, and
the parallel O(n^2) reference. On CUDA the chunked form can run as mlstm_kernels' Triton kernel (same layout and state conventions; op.py)
when that package is installed; it is never required. Its forward is exact; its backward is mlstm_kernels'
own, which sends no gradient through the normaliser max(|n . q|, exp(-m)): dv is exact, dq, dk, di and df
differ from the exact gradient where |n . q| is the larger term (tests/layers/test_mlstm.py). mlstm_kernel=native
trains with the exact gradient. Its two ops have CPU stand-ins with the same output
contract, which run on the CPU standing in for CUDA (attention/simulate_cuda.py).

With packed documents (docs, attention/documents.py) every document's first token starts from the zero state
(m = 0), as if the sequence began there: the three forms exactly (masks inside chunks, the state dropped
between them); the Triton kernel, which takes no documents, with the forget gate closed at that token (op.py's
RESTART_FORGET, within float32 rounding of the exact forms).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from attention import simulate_cuda
from attention.documents import begins_document
from attention.memory import F32, linear_inputs, padded
from attention.ops.mlstm.op import (TRITON_CHUNK, mlstm_sequence, triton_available, triton_head_problem,
                                    triton_runs_on)
from attention.ops.mlstm.cell import mlstm_cell
from attention.ops.recurrence import FORMS
from attention.ops.recurrence.memory import chunked_saved
from attention.call import MixerCall
from attention.registry import RecurrentMixer, Setting, chunk_loop_problem, register

MLSTM_N_HEAD = Setting("mlstm_n_head", int, 8, "mlstm: heads of the matrix memory, independent of n_head (xLSTM 7B's "
                       "8: q/k 256, v 512 at d=4096)")
MLSTM_QK_DIM_FACTOR = Setting("mlstm_qk_dim_factor", float, 0.5, "mlstm: q, k width as a fraction of n_embd (v keeps "
                              "n_embd), xLSTM 7B")
MLSTM_GATE_SOFT_CAP = Setting("mlstm_gate_soft_cap", float, 15.0, "mlstm: input/forget gate pre-activations "
                              "soft-capped to (-cap, cap)")
MLSTM_CHUNK = Setting("mlstm_chunk", int, 64, "mlstm: chunk length of the chunkwise-parallel training form")
MLSTM_KERNEL = Setting("mlstm_kernel", str, "auto", "mlstm: auto (mlstm_kernels' Triton chunkwise kernel, chunk 64, "
                       "for CUDA training when installed; its backward treats the normaliser as a constant) | "
                       "native (the exact gradient) | triton")

NORM_EPS = 1e-6  # xLSTM 7B's per-head LayerNorm


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return cap * torch.tanh(x / cap)


@register("mlstm")
class MLSTMLayer(RecurrentMixer):
    paper = "003"
    summary = "every j <= i, through xLSTM 7B's matrix memory (exponential input, sigmoid forget gates)"
    settings = (MLSTM_N_HEAD, MLSTM_QK_DIM_FACTOR, MLSTM_GATE_SOFT_CAP, MLSTM_CHUNK, MLSTM_KERNEL)
    forms = FORMS
    takes_documents = True  # every form restarts the state at a document's first token
    context_parallel = True  # the core starts each shard from the state its earlier shards leave
    translation_invariant = True  # a state from zero at a document's start, RoPE's relative positions
    gpu_kernel = ("mlstm_kernel", "triton", "mlstm_kernels", "kernel triton")

    @classmethod
    def example_settings(cls, window):
        # two memory heads: from the tools' narrowest width (n_embd 64) up, q/k and v heads are wide enough
        # (>= 16) for the Triton kernel, so the small models run the kernel a GPU trains with
        return {"mlstm_n_head": 2}

    def kernel_inputs(self, batch, seq_len, device, dtype, generator=None):
        """q, k, v as the layer's projections give them and the gate pre-activations near their
        initialisation (input -10, forget 3..6), where the stabiliser matters most."""
        def randn(*shape, scale=1.0, shift=0.0, type_=dtype):
            return (torch.randn(shape, generator=generator, device=device, dtype=type_) * scale + shift)
        H, dk = self.n_head, self.qk_dim // self.n_head
        q, k = randn(batch, H, seq_len, dk), randn(batch, H, seq_len, dk)
        v = randn(batch, H, seq_len, self.v_head_dim)
        i = randn(batch, H, seq_len, scale=2.0, shift=-10.0, type_=torch.float32)
        f = randn(batch, H, seq_len, shift=4.0, type_=torch.float32)
        return tuple(t.requires_grad_() for t in (q, k, v, i, f))

    def kernel_forward(self, q, k, v, i, f):
        kernel = "triton" if self.triton and triton_runs_on(q.device) else "native"
        return mlstm_sequence(q, k, v, i, f, chunk=self.chunk, kernel=kernel, need_state=False)[0]

    @classmethod
    def check_config(cls, config):
        heads = config.mlstm_n_head
        if heads < 1 or config.n_embd % heads:
            raise ValueError(f"mlstm_n_head={heads}: must be >= 1 and divide n_embd={config.n_embd}")
        qk_dim = int(config.n_embd * config.mlstm_qk_dim_factor)
        if qk_dim < heads or qk_dim % heads:
            raise ValueError(f"mlstm_qk_dim_factor={config.mlstm_qk_dim_factor}: q/k width {qk_dim} must be a "
                             f"positive multiple of mlstm_n_head={heads}")
        if config.mlstm_chunk < 1:
            raise ValueError(f"mlstm_chunk={config.mlstm_chunk}: must be >= 1")
        if config.mlstm_gate_soft_cap <= 0:
            raise ValueError(f"mlstm_gate_soft_cap={config.mlstm_gate_soft_cap}: must be > 0")
        if config.mlstm_kernel not in ("auto", "native", "triton"):
            raise ValueError(f"mlstm_kernel={config.mlstm_kernel!r}: expected auto, native or triton")
        narrow = triton_head_problem(qk_dim // heads, config.n_embd // heads)
        if config.mlstm_kernel == "triton" and narrow:
            raise ValueError(f"mlstm_kernel=triton: {narrow}; or mlstm_kernel=auto, which uses the built-in form here")

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.n_head = config.mlstm_n_head  # the memory's heads, not the attention layers'
        self.qk_dim = int(config.n_embd * config.mlstm_qk_dim_factor)
        self.v_head_dim = config.n_embd // self.n_head
        self.chunk, self.soft_cap, self.kernel = config.mlstm_chunk, config.mlstm_gate_soft_cap, config.mlstm_kernel
        # resolved once here, not inside a compiled forward: the Triton kernel trains on CUDA when installed and
        # the heads are wide enough for it (auto falls back to the built-in form and describe() says why)
        self.narrow = triton_head_problem(self.qk_dim // self.n_head, self.v_head_dim)
        self.triton = self.kernel != "native" and triton_available() and not self.narrow
        if self.kernel == "triton" and not self.triton:
            raise ValueError("mlstm_kernel=triton needs the mlstm_kernels package with triton (pip install -r "
                             "requirements-gpu.txt on a CUDA machine); use mlstm_kernel=native or auto")
        self.q = nn.Linear(config.n_embd, self.qk_dim, bias=config.bias)
        self.k = nn.Linear(config.n_embd, self.qk_dim, bias=config.bias)
        self.v = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.o_gate = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.i_gate = nn.Linear(config.n_embd, self.n_head, bias=True)
        self.f_gate = nn.Linear(config.n_embd, self.n_head, bias=True)
        self.norm_weight = nn.Parameter(torch.ones(config.n_embd))  # per-head LayerNorm, weight only (xLSTM 7B)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def init_weights(self):
        # xLSTM 7B: gates start from their biases alone; a very negative input gate writes little into the
        # memory early on, and forget biases 3..6 over heads (sigmoid 0.95..0.998) give a range of time scales
        nn.init.zeros_(self.i_gate.weight)
        nn.init.zeros_(self.f_gate.weight)
        nn.init.constant_(self.i_gate.bias, -10.0)
        with torch.no_grad():
            self.f_gate.bias.copy_(torch.linspace(3.0, 6.0, self.n_head))

    def forward(self, x, call: MixerCall):
        B, T, C = x.shape
        pos, cache, docs = call.pos, call.cache, call.docs
        starts = None if docs is None else begins_document(docs, pos)
        q = self.q(x).view(B, T, self.n_head, -1).transpose(1, 2)
        k = self.k(x).view(B, T, self.n_head, -1).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_head, -1).transpose(1, 2)
        i = soft_cap(self.i_gate(x), self.soft_cap).transpose(1, 2)  # (B, H, T)
        f = soft_cap(self.f_gate(x), self.soft_cap).transpose(1, 2)
        # exponential gates and long sums: float32 or better, also under autocast (the Triton kernel takes
        # q, k, v in the autocast dtype and does the same inside); the output goes back in the projections' dtype
        compute, activation = torch.promote_types(q.dtype, torch.float32), q.dtype
        triton = self.triton and triton_runs_on(x.device) and cache is None and call.shard is None
        with torch.autocast(x.device.type, enabled=False):
            if not triton:
                q, k, v = (t.to(compute) for t in (q, k, v))
            h = self.cell(q, k, v, i.to(compute), f.to(compute), cache, "triton" if triton else "native", starts,
                          call.shard)
            h = h.to(compute)
            # per-head LayerNorm without bias, weight shared layout with xLSTM 7B's MultiHeadLayerNorm
            h = F.layer_norm(h.transpose(1, 2), (self.v_head_dim,), eps=NORM_EPS).reshape(B, T, C)
        h = (h * self.norm_weight.to(compute)).to(activation)
        return self.resid_dropout(self.c_proj(torch.sigmoid(self.o_gate(x)) * h))

    def cell(self, q, k, v, i, f, cache, kernel="native", starts=None, shard=None):
        if cache is not None and q.shape[2] == 1:
            h, cache.state = mlstm_cell(q, k, v, i, f, cache.state, starts=starts, form="step")
            return h
        h, state = mlstm_sequence(q, k, v, i, f, None if cache is None else cache.state, self.chunk, kernel,
                                  need_state=cache is not None, starts=starts, form=self.form, shard=shard)
        if cache is not None:
            cache.state = state
        return h

    def compile_problem(self, seq_len, device, dtype):
        if self.triton and triton_runs_on(device):
            return ""  # mlstm_kernels' Triton kernel: one op in the graph
        return chunk_loop_problem("mlstm", seq_len, self.chunk, "install mlstm_kernels with triton on the CUDA "
                                  "machine (pip install -r requirements-gpu.txt) for its Triton kernel")

    def mixing_flops(self, seq_len):
        qk_head = self.qk_dim // self.n_head
        chunk = TRITON_CHUNK if self.triton else self.chunk  # the chunk the training form runs with
        within = chunk / 2 * (qk_head + self.v_head_dim)  # q.k and the weighted sum over a chunk's keys
        across = 2 * qk_head * self.v_head_dim  # reading the state and (amortised) writing it
        return self.n_head * 2 * (within + across)

    def resolved_settings(self, seq_len, device, dtype):
        return {"mlstm_kernel": "triton" if self.triton and triton_runs_on(device) else "native"}

    def describe(self):
        if self.triton:
            where = "on CUDA; its CPU stand-in while simulating CUDA" if simulate_cuda.active() else "on CUDA"
            kernel = f"kernel triton (mlstm_kernels, chunk {TRITON_CHUNK}, {where})"
        elif self.kernel == "auto" and self.narrow and triton_available():
            kernel = f"kernel native ({self.narrow})"
        else:
            kernel = "kernel native"
        return (f"mLSTM: {self.n_head} heads, q/k {self.qk_dim // self.n_head} and v {self.v_head_dim} per head, "
                f"chunk {self.chunk}, {kernel}")

    def saved_activations(self, m, k, B: int, T: int):
        """mLSTM (attention/mlstm.py). Shared by both cells, per token (a = activation bytes, C = n_embd, H heads):

            linear inputs      q, k, v, o_gate, i_gate, f_gate: 6 a C under autocast (one cast each), else 4 C
            gates              tanh (soft cap) of i and f (2 a H), float32 i and f (8 H)
            cell output h      4 C (float32), kept by the per-head LayerNorm, with its mean and 1/std (8 H)
            after the norm     the normed h (4 C, for norm_weight's gradient), h in the activation dtype and
                               sigmoid(o_gate) (the product's operands, 2 a C), the product (c_proj's input, a C)

        Cell, triton (mlstm_kernels, CUDA): q, k, v as given (the linears' outputs, a (2 d_qk + d_v) per head)
        and the float32 normaliser and stabiliser per head and position (8 H); the chunk states are recomputed.
        Cell, native (float32 for every input): per position and head, what the recurrence core's stabilised
        chunked form keeps over v with its column of ones (dv + 1 values; attention/ops/recurrence/memory.py), and
        the cell's own: q and k cast to float32 (2 dk), the reads its normalised read divides (dv + 1) and ~5
        gates and denominators."""
        C, H, a, tokens = m.n_embd, self.n_head, k.act, B * T  # the memory's heads (mlstm_n_head)
        dk, dv = self.qk_dim // H, self.v_head_dim
        triton = k.device == "cuda" and self.kernel != "native" and not self.narrow  # (installed on the GPU)
        saved = {"linear inputs": tokens * linear_inputs(k, 6, C),
                 "gates (soft cap, fp32 i and f)": tokens * H * (2 * a + 2 * F32)}
        if triton:
            saved["triton kernel inputs q, k, v"] = a * tokens * H * (2 * dk + dv)
            saved["triton normaliser and stabiliser (fp32)"] = 2 * F32 * tokens * H
            matmuls = 0
        else:
            L = self.chunk
            n = padded(T, L)
            per_head = chunked_saved(L, dk, dv + 1, decay=True, gain=True, stabilised=True) + 2 * dk + (dv + 1) + 5
            saved["chunkwise cell (fp32)"] = int(F32 * B * H * n * per_head)
            matmuls = int(F32 * B * H * n * (L + 2 * dv + 1 + dk * dv / L))
        saved["cell output h (fp32) and norm statistics"] = F32 * tokens * (C + 2 * H)
        saved["normed h (fp32)"] = F32 * tokens * C
        saved["h, sigmoid(o_gate) and their product"] = 3 * a * tokens * C
        linear_outputs = a * tokens * (2 * self.qk_dim + C + C + 2 * H + C)  # q, k, v, o_gate, i, f, c_proj
        return saved, matmuls + linear_outputs
