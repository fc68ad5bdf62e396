"""Activation memory of the token mixers: what one layer's mixer keeps for backward, in bytes, for
runtime/memory_plan.py (scripts/plan_memory.py). Every mixer answers saved_activations(config, kernels, B, T) ->
(saved tensors by name, the part selective checkpointing keeps: its matmul and kernel outputs), its
ActivationMemory capability (attention/capabilities.py). Attention under edge rules gets
its estimate from its rules and kernels (attention_saved, the MaskedAttention default); a mixer with other
internals states its own in its module, from the helpers here. The estimate is of eager PyTorch on the
kernels of `Kernels.device` (see runtime/memory_plan.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention.edges import Causal
from attention.kernels import plan_attention, resolve_backend
from attention.ops.blocks import block_structure

F32 = 4  # bytes of a float32 element: the residual stream, norms' statistics, recurrent states, the loss


@dataclass(frozen=True)
class Kernels:
    """What runs: `device` picks the kernels (cuda or cpu, see the module docstring) and `act` is the bytes of
    an activation produced by a matmul: 2 under bf16/fp16 autocast, 4 in float32. Under autocast every linear
    layer casts its float32 input to bf16 itself (autocast caches only the casts of leaf parameters), so two
    linears reading the same norm output keep two bf16 copies of it; in float32 they share the one tensor."""

    device: str = "cuda"
    act: int = 2

    @property
    def autocast(self) -> bool:
        return self.act < F32


def linear_inputs(k: Kernels, consumers: int, C: int) -> int:
    """Bytes per token that `consumers` linear layers reading one float32 tensor of width C keep as their
    saved input: one bf16 cast each under autocast, else the float32 tensor itself, once."""
    return consumers * k.act * C if k.autocast else F32 * C


# ---- parameters, gradients, optimizer ------------------------------------------------------------------------


def rope_tables(T: int, dim: int) -> int:
    """apply_rope keeps cos and sin (T, dim/2) in float32 for q and for k: 8 T dim bytes, whatever the batch."""
    return 4 * F32 * T * dim // 2


def padded(n: int, chunk: int) -> int:
    return -(-n // chunk) * chunk


def kernel_saved(kernel: str, rule, activation: str, k: Kernels, B: int, H: int, D: int, n: int) -> dict[str, int]:
    """What one attention kernel call over n positions keeps beyond q, k, v (B, H, n, D):

        span, flex, sdpa    the output and the float32 log-sum-exp per head and position; flex's sigmoid
                            attention (swat) also keeps the float32 output and exp(lse) that rescale it;
                            sdpa under a rule other than causal also keeps its dense (n, n) mask as a bias
        chunked (CPU)       softmax: the output and the log-sum-exp over whole chunks (ChunkedFlashCPU);
                            sigmoid: the float32 probabilities of every query chunk's key tiles (ChunkedSigmoid:
                            per position and head, the key chunks holding its edges, c keys each), no output
    """
    a, rows = k.act, B * H
    if kernel == "span":
        return {"attention output": a * rows * n * D, "attention lse (fp32)": F32 * rows * n}
    if kernel in ("flex", "sdpa"):
        saved = {"attention output": a * rows * n * D, "attention lse (fp32)": F32 * rows * n}
        if activation == "sigmoid":
            saved["sigmoid rescaling: fp32 output and exp(lse)"] = F32 * rows * n * (D + 1)
        if kernel == "sdpa" and not isinstance(rule, Causal):  # a dense mask, kept as an additive bias
            saved["attention mask as bias"] = a * (H if rule.per_head else 1) * n * n
        return saved
    if kernel == "chunked" and k.device == "cpu":
        groups = rule.head_groups() or [(list(range(H)), rule)]
        if activation == "sigmoid":
            probs = 0
            for heads, sub_rule in groups:
                c = sub_rule.chunk_size()
                slots = block_structure(sub_rule, n, c, len(heads), "cpu").shape[1]  # key chunks per query chunk
                probs += F32 * B * len(heads) * padded(n, c) * slots * c
            return {"sigmoid probabilities (fp32)": probs}
        lse = sum(F32 * B * len(heads) * padded(n, sub_rule.chunk_size()) for heads, sub_rule in groups)
        return {"attention output": a * rows * n * D, "attention lse (fp32)": lse}
    raise ValueError(f"no memory model for the {kernel!r} attention kernel on {k.device}: the estimate covers span, flex "
                     "and sdpa on CUDA (attn_backend=auto with head_dim >= 16), chunked and sdpa on CPU")


def attention_saved(mixer, m, k: Kernels, B: int, T: int) -> tuple[dict[str, int], int]:
    """Attention under one or more edge rules (full, swa, block, mswa, swat, the bridges' union form) and the
    parts every attention variant shares. Per token, with a = activation bytes and C = n_embd:

        c_attn input        a C under autocast (its own cast), else the norm output (4 C)
        qkv                 3 a C: v is a view into c_attn's output, so saving v keeps all of it
        q, k after RoPE     2 a C (new tensors; without RoPE q and k are views into qkv too)
        kernel              output a C and lse 4 H (see kernel_saved)
        merged heads        a C: (B, H, T, D) -> (B, T, C) is a copy, saved by the gate or c_proj
        gate (attn_gate)    sigmoid(W y) and sigmoid(W y) * y: 2 a C
    plus RoPE's cos/sin tables (rope_tables). Where the CPU's chunked kernel gathers every head's keys by index
    (compacted tiles, gathered_key_heads) it keeps copies of k and v with one zero row after the end instead of k and
    v themselves: then of q, k and v only q survives (after RoPE; without RoPE q is a view that keeps qkv). Returns
    the saved tensors and the matmul and kernel outputs selective checkpointing keeps."""
    C, H, D, a, tokens = m.n_embd, m.n_head, m.head_dim, k.act, B * T
    kernels = [(rule, resolve_backend(mixer.backend, rule, torch.device(k.device), D)) for rule in mixer.paths()]
    gathered = [gathered_key_heads(kernel, rule, k, T, H, D) for rule, kernel in kernels]
    only_copies = all(heads == H for heads in gathered)  # every path reads its own copies of k and v
    saved = {"c_attn input": tokens * linear_inputs(k, 1, C)}
    if not (only_copies and mixer.rope_theta is not None):
        saved["qkv"] = 3 * a * C * tokens
    if mixer.rope_theta is not None:
        saved["q after RoPE" if only_copies else "q, k after RoPE"] = (1 if only_copies else 2) * a * C * tokens
        saved["RoPE cos/sin tables"] = rope_tables(T, D)
    if any(gathered):
        saved["k and v gathered copies"] = sum(2 * a * B * heads * (T + 1) * D for heads in gathered)
    kernel_out = 0
    for rule, kernel in kernels:
        for name, size in kernel_saved(kernel, rule, mixer.activation, k, B, H, D, T).items():
            saved[name] = saved.get(name, 0) + size
        kernel_out += a * tokens * C + F32 * B * H * T
    saved["merged heads"] = a * C * tokens
    if mixer.gate is not None:
        saved["output gate"] = 2 * a * C * tokens
    matmuls = a * tokens * (3 * C + C + (C if mixer.gate is not None else 0))
    return saved, matmuls + kernel_out


def gathered_key_heads(kernel: str, rule, k: Kernels, T: int, H: int, D: int) -> int:
    """The heads whose keys the CPU's chunked kernel gathers by index from copies of k and v (compacted tiles:
    attention/ops/chunked/groups.py, key_source) rather than slicing a band of them: read off its plan."""
    if kernel != "chunked" or k.device != "cpu":
        return 0
    plan = plan_attention(rule, "chunked", T, H, D, "cpu")
    return sum(len(group.heads) for group in plan.data.groups if getattr(group.data, "band", 0) is None)


def window_path_saved(rule, k: Kernels, B: int, H: int, D: int, T: int) -> dict[str, int]:
    """The bridge path of branch fusion (attention/ops/window.py: window_attention): one (R rows x K keys) tile
    per boundary window j < J, gathered by index_select and run through one masked SDPA call, then scattered
    back by index_copy, which keeps its source (the tile rows inside the sequence) for backward.

        cuda (memory-efficient SDPA)  q tiles J R D, k and v tiles 2 J K D, output J R D (per batch and head,
                                      activation bytes), lse J R (fp32), and the mask as a bias (H J R K,
                                      activation bytes, shared by the batch)
        cpu (SDPA's math path)        q and k scaled (J R D + J K D), probabilities J R K, v tiles J K D, in
                                      float32 also under bf16 autocast (the math path computes in float32 there)
    """
    first_row, _, R, K = rule.window_tiles(T)
    J, a = len(first_row), k.act
    inside = int(sum(min(R, T - int(row)) for row in first_row))
    rows = B * H
    if k.device == "cuda":
        saved = {"bridge tiles q, k, v": a * rows * J * (R + 2 * K) * D, "bridge tile output": a * rows * J * R * D,
                 "bridge tile lse (fp32)": F32 * rows * J * R, "bridge tile mask as bias": a * H * J * R * K}
    else:
        saved = {"bridge tiles q, k, v (scaled, fp32)": F32 * rows * J * (R + 2 * K) * D,
                 "bridge tile probabilities (fp32)": F32 * rows * J * R * K}
    saved["bridge rows scattered back"] = a * rows * inside * D
    return saved
