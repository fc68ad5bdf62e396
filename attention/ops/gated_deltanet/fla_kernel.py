"""fla's (flash-linear-attention's) Triton chunk kernel for the gated delta rule, looked up when installed (CUDA only),
and its CPU stand-in with fla's contract, run while the CPU stands in for CUDA (attention/simulate_cuda.py)."""

from __future__ import annotations

import functools

import torch

from attention import simulate_cuda
from attention.ops.recurrence import Gates, State, chunked_recurrence


@functools.cache
def fla_chunk_kernel():
    """fla's chunk_gated_delta_rule, or None when the package is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def _fla_l2norm(x):
    """fla's l2norm_fwd (fla/modules/norm/l2norm.py): x / sqrt(sum x^2 + 1e-6), in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


@torch.compiler.disable  # as fla's own chunk_gated_delta_rule: compiled code breaks its graph around it
def fla_chunk_stand_in(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=False, chunk_size=64, **unused):
    """fla's chunk_gated_delta_rule on the CPU standing in for CUDA (attention/simulate_cuda.py): computed with
    the recurrence core's chunked form (the delta rule) in float32, with fla-core 0.6.0's contract (fla/ops/gated_delta_rule/chunk.py):
    q, k (B, T, H, K), v (B, T, H, V), g (log decay) and beta (B, T, H) in the (B, T, H, ...) layout; scale
    defaults to K^-0.5; use_qk_l2norm_in_kernel normalises q and k as fla's l2norm_fwd (eps 1e-6 inside the
    square root); the state is (B, H, K, V) (state_v_first=False). Returns o (B, T, H, V) in q's dtype
    (ChunkGatedDeltaRuleFunction.forward: o.to(q.dtype)), contiguous, and the final state in float32
    (chunk_gated_delta_rule_fwd_h: k.new_zeros(N, HV, K, V, dtype=torch.float32)) when output_final_state, else
    None. Gradients reach q, k, v, g, beta and the initial state in their own dtypes, as fla's backward gives
    them (dq.to(q), ...)."""
    simulate_cuda.ran("flash-linear-attention")
    if scale is None:
        scale = k.shape[-1] ** -0.5
    if chunk_size not in (16, 32, 64):  # fla's own refusal
        raise ValueError(f"`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got {chunk_size}.")
    with torch.autocast(q.device.type, enabled=False):  # float32 throughout, also when called under autocast
        if use_qk_l2norm_in_kernel:
            q_, k_ = _fla_l2norm(q), _fla_l2norm(k)
        else:
            q_, k_ = q.float(), k.float()
        heads_first = lambda t: t.transpose(1, 2)  # noqa: E731  (B, T, H, ...) -> (B, H, T, ...)
        state = None if initial_state is None else State(initial_state.float())
        gates = Gates(log_decay=heads_first(g.float()), beta=heads_first(beta.float()))
        y, _, final = chunked_recurrence(heads_first(q_ * scale), heads_first(k_), heads_first(v.float()), gates, state,
                                         chunk_size)
    return y.transpose(1, 2).to(q.dtype).contiguous(), (final.S.float() if output_final_state else None)
