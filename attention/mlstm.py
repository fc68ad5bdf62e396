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

Three forms, equal to float tolerance (tests, which also compare with `mlstm_kernels`' own sequence kernel):
    quadratic   the reference, O(n^2): the whole log-weight matrix at once
    chunkwise   training, O(n): exact within chunks of mlstm_chunk tokens, the state (C, n, m) between them
    recurrent   generation: one token at a time, constant memory
On CUDA the chunkwise form can run as mlstm_kernels' Triton kernel (same layout and state conventions)
when that package is installed; it is never required. Its forward is exact; its backward is mlstm_kernels'
own, which sends no gradient through the normaliser max(|n . q|, exp(-m)): dv is exact, dq, dk, di and df
differ from the exact gradient where |n . q| is the larger term (tests/test_mlstm.py). mlstm_kernel=native
trains with the exact gradient. Its two ops have CPU stand-ins with the same output
contract, which run on the CPU standing in for CUDA (attention/simulate_cuda.py).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from attention import simulate_cuda
from attention.memory import F32, linear_inputs, padded
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

EPS = 1e-6
NORM_EPS = 1e-6  # xLSTM 7B's per-head LayerNorm
# an input-gate pre-activation for padding positions: they add nothing to the state (exp underflows to 0)
# and, with log f = 0, leave C, n and m as they were; finite so that no inf - inf appears
_NO_INPUT = -1e30


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return cap * torch.tanh(x / cap)


def _zero_state(q, v):
    B, H, _, dk = q.shape
    return (q.new_zeros(B, H, dk, v.shape[-1]), q.new_zeros(B, H, dk), q.new_zeros(B, H, 1))


def quadratic_mlstm(q, k, v, i, f, state=None, eps: float = EPS):
    """Reference form over the whole sequence: q, k (B, H, n, d_qk), v (B, H, n, d_v), gate pre-activations
    i, f (B, H, n). state: (C, n, m) before the first token, or None (zeros, m = 0). Returns h (B, H, n, d_v)."""
    C0, n0, m0 = _zero_state(q, v) if state is None else state
    length = q.shape[2]
    q = q * q.shape[-1] ** -0.5
    log_f = F.logsigmoid(f).cumsum(-1)  # B_t = sum_{s <= t} log f_s
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    # log weight of key j in h_t: B_t - B_j + i_j; of the initial state: B_t + m_0
    log_weights = torch.where(causal, log_f[..., :, None] - log_f[..., None, :] + i[..., None, :], -torch.inf)
    log_initial = log_f + m0
    m = torch.maximum(log_weights.amax(-1), log_initial)  # the recurrent stabiliser m_t
    weights = torch.exp(log_weights - m[..., None]) * (q @ k.transpose(-1, -2))
    initial = torch.exp(log_initial - m)[..., None]
    numerator = weights @ v + initial * (q @ C0)
    qn = weights.sum(-1, keepdim=True) + initial * (q @ n0[..., None])
    return numerator / (torch.maximum(qn.abs(), torch.exp(-m)[..., None]) + eps)


def recurrent_mlstm(q, k, v, i, f, state=None, eps: float = EPS):
    """Token by token: the generation form. Returns h (B, H, n, d_v) and the state (C, n, m) after the last token."""
    C, n, m = _zero_state(q, v) if state is None else state
    scale = q.shape[-1] ** -0.5
    outputs = []
    for t in range(q.shape[2]):
        log_f, i_t = F.logsigmoid(f[:, :, t, None]), i[:, :, t, None]
        m_new = torch.maximum(log_f + m, i_t)
        decay, gain = torch.exp(log_f + m - m_new), torch.exp(i_t - m_new)
        k_t, q_t = k[:, :, t], q[:, :, t] * scale
        C = decay[..., None] * C + gain[..., None] * (k_t[..., :, None] * v[:, :, t, None, :])
        n = decay * n + gain * k_t
        m = m_new
        qn = (q_t * n).sum(-1, keepdim=True)
        outputs.append((q_t[..., None, :] @ C).squeeze(-2) / (torch.maximum(qn.abs(), torch.exp(-m)) + eps))
    return torch.stack(outputs, dim=2), (C, n, m)


def chunkwise_mlstm(q, k, v, i, f, state=None, chunk: int = 64, eps: float = EPS, return_stats: bool = False):
    """O(n) training form: the quadratic form inside chunks of `chunk` tokens, the recurrence between them.

    Returns h (B, H, n, d_v) and the state (C, n, m) after the last token; with return_stats also each
    position's denominator max(|n . q~|, exp(-m)) and stabiliser m, (B, H, n) each (what mlstm_kernels' forward
    returns as vecN_out and vecM_out). Memory is O(n * chunk): the chunk states are computed by a scan over
    chunks, then every chunk's outputs in one batched pass.
    """
    B, H, length, dk = q.shape
    pad = -length % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        i = F.pad(i, (0, pad), value=_NO_INPUT)
        f = F.pad(f, (0, pad), value=torch.inf)  # log sigmoid(inf) = 0: no decay
    nc = (length + pad) // chunk
    q = q * dk ** -0.5
    qc, kc, vc = (t.reshape(B, H, nc, chunk, -1) for t in (q, k, v))
    ic = i.reshape(B, H, nc, chunk)
    log_f = F.logsigmoid(f).reshape(B, H, nc, chunk).cumsum(-1)  # b_t within each chunk
    total = log_f[..., -1]  # (B, H, nc): a chunk's whole decay
    # each chunk's own contribution to the state at its end, stabilised by its largest log weight g
    log_to_end = total[..., None] - log_f + ic  # b_L - b_j + i_j
    # max().values, not amax(): amax's backward divides by the number of ties, which inductor recomputes in
    # backward and can find 0 of (NaN gate gradients from bf16 gates under autocast); max's goes to one index
    g = log_to_end.max(-1).values
    to_end = torch.exp(log_to_end - g[..., None])[..., None] * kc  # (B, H, nc, L, dk)
    chunk_C, chunk_n = to_end.transpose(-1, -2) @ vc, to_end.sum(-2)

    # the scan over chunks: states before each chunk (C, n, m), as the recurrence would have them. The inputs
    # are unbound once: indexing chunk c inside the loop would give each step a backward the size of the
    # whole sequence (O(n^2) in all)
    C, n, m = _zero_state(q, v) if state is None else state
    states = []
    steps = zip(total.unsqueeze(-1).unbind(2), g.unsqueeze(-1).unbind(2), chunk_C.unbind(2), chunk_n.unbind(2))
    for chunk_total, chunk_max, contribution_C, contribution_n in steps:
        states.append((C, n, m))
        m_new = torch.maximum(chunk_total + m, chunk_max)
        decay, gain = torch.exp(chunk_total + m - m_new), torch.exp(chunk_max - m_new)
        C = decay[..., None] * C + gain[..., None] * contribution_C
        n = decay * n + gain * contribution_n
        m = m_new
    C_before = torch.stack([s[0] for s in states], dim=2)  # (B, H, nc, dk, dv)
    n_before = torch.stack([s[1] for s in states], dim=2)  # (B, H, nc, dk)
    m_before = torch.stack([s[2] for s in states], dim=2)  # (B, H, nc, 1)

    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    log_weights = torch.where(causal, log_f[..., :, None] - log_f[..., None, :] + ic[..., None, :], -torch.inf)
    log_initial = log_f + m_before  # (B, H, nc, L)
    m_t = torch.maximum(log_weights.max(-1).values, log_initial)  # (max, not amax: see g above)
    weights = torch.exp(log_weights - m_t[..., None]) * (qc @ kc.transpose(-1, -2))
    initial = torch.exp(log_initial - m_t)[..., None]
    numerator = weights @ vc + initial * (qc @ C_before)
    qn = weights.sum(-1, keepdim=True) + initial * (qc @ n_before[..., None])
    denominator = torch.maximum(qn.abs(), torch.exp(-m_t)[..., None])
    h = (numerator / (denominator + eps)).reshape(B, H, nc * chunk, -1)[:, :, :length]
    if return_stats:
        stats = tuple(t.reshape(B, H, nc * chunk)[:, :, :length] for t in (denominator, m_t))
        return h, (C, n, m), stats
    return h, (C, n, m)


TRITON_CHUNK = 64  # the chunk mlstm_kernels' Triton kernel runs with (its tuned default)
TRITON_MIN_HEAD_DIM = 16  # Triton's tl.dot needs inner dimensions of at least 16: the kernel's blocks follow the heads


def triton_head_problem(qk_head_dim: int, v_head_dim: int) -> str:
    """Why the Triton kernel cannot take these head widths ("" when it can): mlstm_kernels sizes its blocks by
    the head widths, and a block below 16 fails to compile."""
    if min(qk_head_dim, v_head_dim) >= TRITON_MIN_HEAD_DIM:
        return ""
    return (f"q/k and v head widths {qk_head_dim} and {v_head_dim}: the Triton kernel needs both >= "
            f"{TRITON_MIN_HEAD_DIM} (fewer mlstm_n_head, a larger mlstm_qk_dim_factor or a wider model)")


_installed: dict = {}


# A constant for torch.compile: compiled code takes its answer instead of tracing the import inside it (a traced
# functools.cache is re-run, and a failing import inside a trace is a graph break)
@torch.compiler.assume_constant_result
def triton_installed() -> bool:
    """Whether mlstm_kernels' Triton chunkwise kernel is installed (the package and triton); asked once."""
    if "triton" not in _installed:
        try:
            import mlstm_kernels.torch.chunkwise.triton_xl_chunk  # noqa: F401
            _installed["triton"] = True
        except ImportError:
            _installed["triton"] = False
    return _installed["triton"]


def triton_available() -> bool:
    """Whether the Triton kernel's ops can run in this process: installed (CUDA), or their CPU stand-ins while
    simulating CUDA on a machine without it (attention/simulate_cuda.py)."""
    return triton_installed() or simulate_cuda.stand_ins()


def triton_runs_on(device) -> bool:
    """Whether the ops run for tensors on device: on CUDA with the package, on the CPU standing in for CUDA."""
    return simulate_cuda.simulated(device) or (torch.device(device).type == "cuda" and triton_installed())


# mlstm_kernels' own autograd.Function keeps its settings as tensors and reads them back with int() and float()
# in backward, which torch.compile cannot trace (a graph break per layer). Its forward and backward kernels are
# wrapped here as two opaque custom ops, so a compiled block holds the kernel as one node of its graph.
@torch.library.custom_op("efficient_attention::mlstm_chunkwise_fw", mutates_args=(), device_types="cuda")
def _triton_fw(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: torch.Tensor, f: torch.Tensor,
               chunk_size: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from mlstm_kernels.torch.chunkwise.triton_xl_chunk.fw import mlstm_chunkwise_fw

    h, n_out, m_out, _, _ = mlstm_chunkwise_fw(matQ=q.contiguous(), matK=k.contiguous(), matV=v.contiguous(),
                                               vecI=i.contiguous(), vecF=f.contiguous(), chunk_size=chunk_size,
                                               eps=eps, output_dtype=torch.float32)
    return h, n_out, m_out


@_triton_fw.register_fake
def _(q, k, v, i, f, chunk_size, eps):
    B, H, S, _ = q.shape
    return q.new_empty(B, H, S, v.shape[-1]), q.new_empty(B, H, S, dtype=torch.float32), \
        q.new_empty(B, H, S, dtype=torch.float32)


@torch.library.custom_op("efficient_attention::mlstm_chunkwise_bw", mutates_args=(), device_types="cuda")
def _triton_bw(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: torch.Tensor, f: torch.Tensor,
               n_out: torch.Tensor, m_out: torch.Tensor, grad_h: torch.Tensor, chunk_size: int,
               eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from mlstm_kernels.torch.chunkwise.triton_xl_chunk.bw import mlstm_chunkwise_bw

    dq, dk, dv, di, df, *_ = mlstm_chunkwise_bw(
        matQ=q.contiguous(), matK=k.contiguous(), matV=v.contiguous(), vecI=i.contiguous(), vecF=f.contiguous(),
        vecN_out=n_out, vecM_out=m_out, matDeltaH_out=grad_h.contiguous(), chunk_size=chunk_size, eps=eps)
    return dq, dk, dv, di.to(i.dtype), df.to(f.dtype)


@_triton_bw.register_fake
def _(q, k, v, i, f, n_out, m_out, grad_h, chunk_size, eps):
    # contiguous, whatever the inputs' strides (the layer passes heads-first views): mlstm_kernels allocates its
    # gradients with torch.empty, dq, dk and dv in q's dtype, and the gate gradients come out of float32 math
    return q.new_empty(q.shape), q.new_empty(k.shape), q.new_empty(v.shape), i.new_empty(i.shape), \
        f.new_empty(f.shape)


def _triton_setup_context(ctx, inputs, output):
    q, k, v, i, f, chunk_size, eps = inputs
    _, n_out, m_out = output
    ctx.save_for_backward(q, k, v, i, f, n_out, m_out)
    ctx.chunk_size, ctx.eps = chunk_size, eps


def _triton_backward(ctx, grad_h, grad_n, grad_m):  # n_out and m_out are kernel internals: no gradient flows
    return (*_triton_bw(*ctx.saved_tensors, grad_h, ctx.chunk_size, ctx.eps), None, None)


_triton_fw.register_autograd(_triton_backward, setup_context=_triton_setup_context)


# The ops' CPU kernels: stand-ins for the Triton kernels, run when the CPU stands in for CUDA
# (attention/simulate_cuda.py), so that compiled code meets on the CPU what it meets on a GPU. They compute with
# chunkwise_mlstm (float32) and return exactly what the CUDA kernels above return, as read from mlstm_kernels
# 2.0.6 (torch/chunkwise/triton_xl_chunk/fw.py, fw_parallel.py, bw.py, bw_parallel_dQ/dK/dV.py,
# chunkwise_gates.py):
#   forward   h (B, NH, S, DHHV) in q's dtype (fw_parallel: torch.empty(B, NH, S, DHHV, dtype=matQ.dtype));
#             vecN_out, vecM_out (B, NH, S) in output_dtype, float32 here: each position's denominator
#             max(|n . q|, exp(-m)) and stabiliser m. All contiguous (torch.empty), whatever the inputs' strides
#             (the kernels read .contiguous() copies: contiguous_noctx)
#   backward  dq, dk (B, NH, S, DHQK) and dv (B, NH, S, DHHV) in q's dtype (grad_output_dtype = matQ.dtype,
#             torch.empty: contiguous); di, df (B, NH, S) float32 (compute_gate_grads_vecDeltaI_vecDeltaF computes
#             in float32), contiguous, then .to(i.dtype), .to(f.dtype) by _triton_bw
@_triton_fw.register_kernel("cpu")
def _cpu_fw(q, k, v, i, f, chunk_size, eps):
    simulate_cuda.ran("mlstm_kernels")
    h, _, (denominator, m) = chunkwise_mlstm(*(t.float() for t in (q, k, v, i, f)), chunk=chunk_size, eps=eps,
                                             return_stats=True)
    return h.to(q.dtype).contiguous(), denominator.contiguous(), m.contiguous()


@_triton_bw.register_kernel("cpu")
def _cpu_bw(q, k, v, i, f, n_out, m_out, grad_h, chunk_size, eps):
    simulate_cuda.ran("mlstm_kernels")
    with simulate_cuda.autograd_in_kernel():  # an op's kernel runs below autograd
        inputs = [t.detach().float().requires_grad_() for t in (q, k, v, i, f)]
        h, _ = chunkwise_mlstm(*inputs, chunk=chunk_size, eps=eps)
        dq, dk, dv, di, df = torch.autograd.grad(h, inputs, grad_h.float())
    return (dq.to(q.dtype).contiguous(), dk.to(q.dtype).contiguous(), dv.to(q.dtype).contiguous(),
            di.contiguous().to(i.dtype), df.contiguous().to(f.dtype))


def _layer_layout(dtype, requires_grad: bool, B: int = 2, H: int = 2, S: int = 128, dqk: int = 16, dv: int = 32):
    """q, k, v and the gates as MLSTMLayer.forward hands them to the ops: heads-first views of (B, S, H, d)
    projections (not contiguous), q, k, v in the activation dtype, the gates in float32, near their
    initialisation (input -10, forget 3..6)."""
    generator = torch.Generator().manual_seed(0)

    def heads_first(*shape, scale=1.0, shift=0.0, type_=dtype):
        t = torch.randn(B, S, H, *shape, generator=generator) * scale + shift
        return t.to(type_).transpose(1, 2).requires_grad_(requires_grad)
    gate = torch.float32
    return (heads_first(dqk), heads_first(dqk), heads_first(dv), heads_first(scale=2.0, shift=-10.0, type_=gate),
            heads_first(shift=4.0, type_=gate))


@simulate_cuda.opcheck_samples("efficient_attention::mlstm_chunkwise_fw")
def _fw_samples():
    return [(*_layer_layout(dtype, True), TRITON_CHUNK, EPS) for dtype in (torch.bfloat16, torch.float32)]


@simulate_cuda.opcheck_samples("efficient_attention::mlstm_chunkwise_bw")
def _bw_samples():
    samples = []
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v, i, f = _layer_layout(dtype, False)
        h, n_out, m_out = _cpu_fw(q, k, v, i, f, TRITON_CHUNK, EPS)
        grad_h = torch.randn(h.shape[0], h.shape[2], h.shape[1], h.shape[3]).transpose(1, 2).to(dtype)
        samples.append((q, k, v, i, f, n_out, m_out, grad_h, TRITON_CHUNK, EPS))
    return samples


def mlstm_sequence(q, k, v, i, f, state=None, chunk: int = 64, kernel: str = "auto", need_state: bool = True):
    """A whole sequence in the training form: mlstm_kernels' Triton kernel on CUDA when it is installed (its CPU
    stand-in while simulating CUDA; kernel auto or triton, from a zero state, when the final state is not
    needed), else chunkwise_mlstm.
    Returns h and the final state (None from the Triton kernel). The Triton kernel takes q, k, v in their own
    dtype (bfloat16 under bf16 training: its matmuls run in bf16 with float32 accumulation, as xLSTM 7B
    trains) and the gates in float32; chunkwise_mlstm computes in float32 or better."""
    triton = kernel != "native" and simulate_cuda.gpu_path(q.device) and state is None and not need_state
    if triton and not triton_runs_on(q.device):
        if kernel == "triton":
            raise RuntimeError("mlstm_kernel=triton needs the mlstm_kernels package (pip install -r "
                               "requirements-gpu.txt); use mlstm_kernel=native or auto")
        triton = False
    if not triton:
        compute = torch.promote_types(q.dtype, torch.float32)
        return chunkwise_mlstm(*(t.to(compute) for t in (q, k, v, i, f)), state, chunk)
    length, kernel_chunk = q.shape[2], TRITON_CHUNK
    pad = -length % kernel_chunk  # the kernel wants whole chunks; padding after the end changes no output
    i, f = i.float(), f.float()
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        i, f = F.pad(i, (0, pad), value=_NO_INPUT), F.pad(f, (0, pad), value=30.0)
    v = v.to(q.dtype)
    return _triton_fw(q, k.to(q.dtype), v, i, f, kernel_chunk, EPS)[0][:, :, :length], None


@register("mlstm")
class MLSTMLayer(RecurrentMixer):
    paper = "003"
    summary = "every j <= i, through xLSTM 7B's matrix memory (exponential input, sigmoid forget gates)"
    settings = (MLSTM_N_HEAD, MLSTM_QK_DIM_FACTOR, MLSTM_GATE_SOFT_CAP, MLSTM_CHUNK, MLSTM_KERNEL)
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

    def forward(self, x, pos, cache=None, plan=None):
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.n_head, -1).transpose(1, 2)
        k = self.k(x).view(B, T, self.n_head, -1).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_head, -1).transpose(1, 2)
        i = soft_cap(self.i_gate(x), self.soft_cap).transpose(1, 2)  # (B, H, T)
        f = soft_cap(self.f_gate(x), self.soft_cap).transpose(1, 2)
        # exponential gates and long sums: float32 or better, also under autocast (the Triton kernel takes
        # q, k, v in the autocast dtype and does the same inside); the output goes back in the projections' dtype
        compute, activation = torch.promote_types(q.dtype, torch.float32), q.dtype
        triton = self.triton and triton_runs_on(x.device) and cache is None
        with torch.autocast(x.device.type, enabled=False):
            if not triton:
                q, k, v = (t.to(compute) for t in (q, k, v))
            h = self.cell(q, k, v, i.to(compute), f.to(compute), cache, "triton" if triton else "native")
            h = h.to(compute)
            # per-head LayerNorm without bias, weight shared layout with xLSTM 7B's MultiHeadLayerNorm
            h = F.layer_norm(h.transpose(1, 2), (self.v_head_dim,), eps=NORM_EPS).reshape(B, T, C)
        h = (h * self.norm_weight.to(compute)).to(activation)
        return self.resid_dropout(self.c_proj(torch.sigmoid(self.o_gate(x)) * h))

    def cell(self, q, k, v, i, f, cache, kernel="native"):
        if cache is not None and q.shape[2] == 1:
            h, cache.state = recurrent_mlstm(q, k, v, i, f, cache.state)
            return h
        h, state = mlstm_sequence(q, k, v, i, f, None if cache is None else cache.state, self.chunk, kernel,
                                  need_state=cache is not None)
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
        Cell, native (chunkwise_mlstm, float32 for every input): per position and head, with chunk L, d_qk = dk,
        d_v = dv, four L-wide tensors (log weights, q k^T, their exponential, the weights), 6 dk (k, q copied
        for three matmuls, k^T and the chunk's decayed keys), 4 dv (the numerator, q C_before, v copied for two
        matmuls) and ~14 scalars (stabilisers, normalisers, gates); per chunk, the state before it, its own
        contribution and the scan's states, 3 (dk dv + dk)."""
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
            per_head = 4 * L + 6 * dk + 4 * dv + 14 + 3 * (dk * dv + dk) / L
            saved["chunkwise cell (fp32)"] = int(F32 * B * H * n * per_head)
            matmuls = int(F32 * B * H * n * (L + 2 * dv + 1 + dk * dv / L))
        saved["cell output h (fp32) and norm statistics"] = F32 * tokens * (C + 2 * H)
        saved["normed h (fp32)"] = F32 * tokens * C
        saved["h, sigmoid(o_gate) and their product"] = 3 * a * tokens * C
        linear_outputs = a * tokens * (2 * self.qk_dim + C + C + 2 * H + C)  # q, k, v, o_gate, i, f, c_proj
        return saved, matmuls + linear_outputs
