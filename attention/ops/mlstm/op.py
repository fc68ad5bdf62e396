"""mlstm_kernels' Triton chunkwise kernel (xLSTM 7B's) as two custom ops with autograd, opaque to torch.compile,
with CPU stand-ins for the CPU standing in for CUDA (attention/simulate_cuda.py); and mlstm_sequence, the training
form a layer runs over a whole sequence: that kernel where it runs, else the cell's chunked form (cell.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attention import simulate_cuda
from attention.ops.mlstm.cell import EPS, mlstm_cell
from attention.ops.recurrence.gates import NO_INPUT

TRITON_CHUNK = 64  # the chunk mlstm_kernels' Triton kernel runs with (its tuned default)
# The forget-gate pre-activation the Triton kernel gets at a document's first token (it takes no documents):
# log sigmoid = -50 puts every weight from before the start below exp(-20) of the largest (gates are soft-capped
# to +-15, so stabilisers lie within +-15). Finite, as the kernel takes differences of cumulative gates, which
# -inf would make NaN; and no larger than it needs to be, as their float32 rounding grows with it (outputs
# within 1e-5 of the exact form's). The exact form keeps the zero state's stabiliser (m = 0), this drops it: the
# two differ by eps exp(m) in the denominator alone
RESTART_FORGET = -50.0
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
# the cell's chunked form (float32) and return exactly what the CUDA kernels above return, as read from mlstm_kernels
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
    h, _, (denominator, m) = mlstm_cell(*(t.float() for t in (q, k, v, i, f)), chunk=chunk_size, eps=eps,
                                        return_stats=True)
    return h.to(q.dtype).contiguous(), denominator.contiguous(), m.contiguous()


@_triton_bw.register_kernel("cpu")
def _cpu_bw(q, k, v, i, f, n_out, m_out, grad_h, chunk_size, eps):
    simulate_cuda.ran("mlstm_kernels")
    with simulate_cuda.autograd_in_kernel():  # an op's kernel runs below autograd
        inputs = [t.detach().float().requires_grad_() for t in (q, k, v, i, f)]
        h, _ = mlstm_cell(*inputs, chunk=chunk_size, eps=eps)
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


def mlstm_sequence(q, k, v, i, f, state=None, chunk: int = 64, kernel: str = "auto", need_state: bool = True,
                  starts=None, form: str = "chunked", shard=None):
    """A whole sequence in the training form: mlstm_kernels' Triton kernel on CUDA when it is installed (its CPU
    stand-in while simulating CUDA; kernel auto or triton, from a zero state, when the final state is not
    needed), else the mLSTM's cell on the recurrence core in its chunked form. starts (B, n) bool: the tokens that begin a document, where the state
    restarts from zero (the Triton kernel closes the forget gate there: RESTART_FORGET); None: none.
    form: the cell's form where the Triton kernel does not run (the conformance tests switch it). Returns h and the
    final state (None from the Triton kernel). The Triton kernel takes q, k, v in their own
    dtype (bfloat16 under bf16 training: its matmuls run in bf16 with float32 accumulation, as xLSTM 7B
    trains) and the gates in float32; the chunked form computes in float32 or better."""
    # a shard under context parallelism starts from its earlier shards' state: the cell on the core
    triton = (kernel != "native" and simulate_cuda.gpu_path(q.device) and state is None and not need_state
              and shard is None)
    if triton and not triton_runs_on(q.device):
        if kernel == "triton":
            raise RuntimeError("mlstm_kernel=triton needs the mlstm_kernels package (pip install -r "
                               "requirements-gpu.txt); use mlstm_kernel=native or auto")
        triton = False
    if not triton:
        compute = torch.promote_types(q.dtype, torch.float32)
        return mlstm_cell(*(t.to(compute) for t in (q, k, v, i, f)), state, chunk, starts=starts, form=form,
                          shard=shard)
    length, kernel_chunk = q.shape[2], TRITON_CHUNK
    pad = -length % kernel_chunk  # the kernel wants whole chunks; padding after the end changes no output
    i, f = i.float(), f.float()
    if starts is not None:  # not at the first token: the state before it is zero already, and its gate keeps its bits
        f = torch.where(starts[:, None] & (torch.arange(length, device=f.device) > 0), RESTART_FORGET, f)
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        i, f = F.pad(i, (0, pad), value=NO_INPUT), F.pad(f, (0, pad), value=30.0)
    v = v.to(q.dtype)
    return _triton_fw(q, k.to(q.dtype), v, i, f, kernel_chunk, EPS)[0][:, :, :length], None
