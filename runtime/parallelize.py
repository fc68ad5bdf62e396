"""How train.py lays a model out over memory and devices: activation checkpointing, compilation, DDP or FSDP.

The order is torchtitan's: activation checkpointing wraps each block, then each block is compiled on its own
(layers with the same mixer share one compiled graph, and everything the blocks need that depends only on the
shape, masks and sa's permutations, is planned by GPT.forward outside them; see Mixer.plan), and, outside FSDP,
the embeddings and the head with its loss (GPT.embed, GPT.head: uncompiled they cost about 15% of a GPT-2 step,
the float32 logits of the loss above all), with cuda_graphs as CUDA graphs (mode="reduce-overhead": a step's
kernels replayed, not launched one by one from python), then data parallelism: DDP around the whole model, or FSDP2
(`fully_shard`) on each block and then on the root, which shards parameters, gradients and optimizer state over the
processes. State-dict keys are those of the bare model whatever is applied.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from attention import simulate_cuda

ACTIVATION_CHECKPOINTING = ("none", "full", "selective")


def _saved_ops() -> set:
    """Ops whose outputs selective checkpointing keeps: the matmuls and the attention kernels (the costly
    recomputations); norms, activations, RoPE and the other elementwise work are recomputed in backward."""
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default,
           aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
           aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default}
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    return ops | ({flex} if flex is not None else set())


def _selective_policy(saved, ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model, mode: str) -> None:
    """Wrap every block of model.blocks in activation checkpointing (torch.utils.checkpoint, non-reentrant).

    full: a block keeps only its input and recomputes everything in backward. selective: it keeps the outputs
    of its matmuls and attention kernels and recomputes the rest (torchtitan's op-level policy). The RNG state
    is restored for the recomputation, so dropout draws the same masks; sa's permutations and the stochastic
    window are fixed before the blocks run (GPT.plan, GPT.set_window), so recomputation sees the same edges.
    """
    if mode not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"activation_checkpointing={mode!r}: expected one of {', '.join(ACTIVATION_CHECKPOINTING)}")
    if mode == "none":
        return
    context_fn = None
    if mode == "selective":
        context_fn = functools.partial(create_selective_checkpoint_contexts,
                                       functools.partial(_selective_policy, _saved_ops()))
    kwargs = {"preserve_rng_state": True} if context_fn is None else {"preserve_rng_state": True, "context_fn": context_fn}
    for i, block in enumerate(model.blocks):  # non-reentrant checkpointing, checkpoint_wrapper's default
        model.blocks[i] = checkpoint_wrapper(block, **kwargs)


def compile_blocks(model, device=None, dtype=None, **options) -> None:
    """torch.compile each block in place (Module.compile: the parameters and state-dict keys stay as they are).
    Refuses (ValueError) when a layer says it should not be compiled at the model's length on this device and
    dtype (Mixer.compile_problem: e.g. a python chunk loop that would take hours to unroll). The backend is
    inductor unless options name one; aot_eager on the CPU standing in for CUDA (attention/simulate_cuda.py:
    CPU inductor has no FlexAttention backward)."""
    if device is not None:
        problems = model.compile_problems(model.config.block_size, device, dtype)
        if problems:
            raise ValueError("; ".join(problems))
        options.setdefault("backend", simulate_cuda.compile_backend(device))
    for block in model.blocks:
        block.compile(**options)


def compile_ends(model, device=None, **options) -> None:
    """torch.compile the model's embeddings and its head with the loss (GPT.embed, GPT.head) in place, as the
    blocks are: the instance's methods are replaced by their compiled forms (parameters and state-dict keys stay
    as they are)."""
    if device is not None:
        options.setdefault("backend", simulate_cuda.compile_backend(device))
    model.embed = torch.compile(model.embed, **options)
    model.head = torch.compile(model.head, **options)


def shard(model, dtype: torch.dtype, reshard_after_forward: bool = True) -> None:
    """FSDP2 in place: each block is one unit (its parameters gathered for its forward and backward, freed
    after them), then the root (embeddings, final norm, LM head). Under bf16 the policy keeps float32 sharded
    parameters, gathers and computes in bf16, and reduces gradients in float32: it replaces autocast."""
    mp_policy = MixedPrecisionPolicy() if dtype == torch.float32 else \
        MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    # the root's parameters are used again by the loss right after the forward: keep them gathered
    fully_shard(model, mp_policy=mp_policy, reshard_after_forward=False)


def compile_options(t, device: torch.device) -> dict:
    """torch.compile's options for the blocks and the ends: mode="reduce-overhead" (CUDA graph trees: each step
    replays recorded graphs, the caller marking each step with torch.compiler.cudagraph_mark_step_begin) with
    t.cuda_graphs. Inductor takes the mode on the CPU too and skips the graphs there; the CPU standing in for CUDA
    compiles with aot_eager, which takes no mode (torch.compile refuses a backend and a mode together): none there."""
    if getattr(t, "cuda_graphs", False) and not simulate_cuda.simulated(device):
        return {"mode": "reduce-overhead"}
    return {}


def parallelize(model, t, device: torch.device, dtype: torch.dtype, distributed: bool, local_rank: int = 0):
    """Activation checkpointing and compilation (in place, per block; CUDA graphs with t.cuda_graphs:
    compile_options), then data parallelism: FSDP2 in place when t.parallelism is fsdp, else DDP around the model
    when running under torchrun. Returns the module the training loop calls."""
    apply_activation_checkpointing(model, t.activation_checkpointing)
    if t.compile:
        options = compile_options(t, device)
        compile_blocks(model, device, dtype, **options)
        if t.parallelism != "fsdp":  # FSDP2 gathers the root's parameters around its forward: left eager there
            compile_ends(model, device, **options)
    if t.parallelism == "fsdp":
        shard(model, dtype, t.fsdp_reshard_after_forward)
        return model
    if distributed:
        return DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    return model
