"""Per-GPU memory of a training config under DDP or FSDP, and the largest micro-batch that fits a GPU.

    python scripts/plan_memory.py configs/swax/swax_1p4b_stochastic.py --gpu_mem_gb=80 --world_size=8
    python scripts/plan_memory.py configs/sa/slimpajama_360m_sa_swa.py --world_size=4 --json=out/plan.json
    python scripts/plan_memory.py configs/swax/swax_7b_stochastic.py --world_size=8       # parallelism=fsdp: sharded
    python scripts/plan_memory.py configs/bridges/owt_124m_pbb.py --batch_size=16 --activation_checkpointing=full

Under DDP every GPU holds the whole model, so its memory is the same on every GPU: fp32 weights, fp32
gradients, DDP's gradient buckets, AdamW's two moments, autocast's bf16 copies of the weights it casts; under
FSDP (the config's parallelism, or --parallelism=fsdp) each GPU holds 1/world_size of the weights, gradients and
AdamW state plus the bf16 weights and gradients of the units gathered at the moment (see static_memory); then the
activations of one micro-batch (batch_size sequences of block_size tokens), which are counted from the model's
own shapes (built on the meta device) and each mixer's code: what every layer keeps for backward with
activation_checkpointing none, full and selective, plus the logits and loss. Then, for each checkpointing mode,
the largest micro-batch that fits gpu_mem_gb less the headroom, and the gradient_accumulation_steps (global,
as in the configs) that keeps the config's global batch of batch_size x gradient_accumulation_steps sequences.

The estimate is of eager PyTorch (torch.compile's partitioner usually keeps less: it fuses the casts and
recomputes cheap elementwise work) on the kernels of `--kernels`: cuda (default: FlexAttention for windowed
attention, SDPA's flash kernel for full attention, mlstm_kernels' and fla's Triton kernels for the recurrent
mixers when their *_kernel setting allows it, as requirements-gpu.txt installs them) or cpu (the chunked CPU
kernels and the built-in chunked recurrent forms: what the tests measure). Sizes are in GiB (2^30 bytes), as
torch.cuda reports them; --gpu_mem_gb is in the same unit. Extra --key=value arguments override the config as
in train.py; vocab_size=0 (from the data) is planned with 50304 (GPT-2's padded vocabulary) and says so.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attention.bridge import BridgedBlockAttention  # noqa: E402
from attention.edges import Causal, PermutedWindow, SlidingWindow, stochastic_halo  # noqa: E402
from attention.gated_deltanet import GatedDeltaNet  # noqa: E402
from attention.kernels import block_structure, resolve_backend  # noqa: E402
from attention.layer import Attention, MaskedAttention  # noqa: E402
from attention.linear import TaylorLinearAttention  # noqa: E402
from attention.mlstm import MLSTMLayer  # noqa: E402
from attention.moba import MixtureOfBlockAttention, moba_gathered  # noqa: E402
from attention.stochastic import GatedStochasticSlidingAttention, StochasticAttention  # noqa: E402
from checkpoint import write_json  # noqa: E402
from config import ConfigError, ModelConfig, apply_args, dataclass_fields, exit_on_config_error, load_config  # noqa: E402
from model import GPT  # noqa: E402

GIB = 2 ** 30
DEFAULT_VOCAB = 50304  # vocab_size = 0 takes the data's vocabulary; plan with GPT-2's, padded to 64
CHECKPOINTING = ("none", "selective", "full")
F32 = 4  # bytes of a float32 element: the residual stream, norms' statistics, recurrent states, the loss


@dataclass
class PlanOptions:
    gpu_mem_gb: float = 80.0  # memory of one GPU in GiB
    world_size: int = 8  # processes, one per GPU
    headroom: float = 0.10  # fraction of gpu_mem_gb left free for the CUDA context and the allocator's slack
    kernels: str = "cuda"  # cuda (the GPU training path) | cpu (the chunked CPU kernels the tests measure)
    compare_loss_chunk: int = 2048  # the loss_chunk the table also plans when the config has none (0)
    json: str = ""  # also write the plan here


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

def count_parameters(model: GPT) -> tuple[int, int]:
    """(all parameters, those autocast casts to bf16). Tied weights count once. Autocast casts the weights
    (and biases) of the layers it runs in bf16, the linear layers and convolutions; the token embedding is
    cast only when it is tied to the LM head, whose matmul then uses it. Norm weights and gate vectors stay
    float32."""
    total = model.num_params()
    cast = {id(p): p.numel() for module in model.modules() if isinstance(module, (nn.Linear, nn.Conv1d))
            for p in module.parameters(recurse=False)}
    return total, sum(cast.values())


@dataclass(frozen=True)
class Layout:
    """How the model is spread over the GPUs: train.py's parallelism over world_size processes."""

    world_size: int = 1
    parallelism: str = "ddp"  # ddp | fsdp
    reshard_after_forward: bool = True  # fsdp_reshard_after_forward


def fsdp_units(model: GPT) -> tuple[int, int]:
    """(parameters of the largest block, parameters of the root unit: embeddings, final norm, LM head)."""
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    return max(blocks), model.num_params() - sum(blocks)


def static_memory(model: GPT, n_params: int, n_cast: int, k: Kernels, layout: Layout) -> dict[str, int]:
    """Bytes that do not depend on the micro-batch. Under DDP:

        weights          4 B/param   float32 master weights (autocast computes in bf16 over float32 parameters)
        gradients        4 B/param   float32 .grad, kept through gradient accumulation until the optimizer step
        DDP buckets      4 B/param   DistributedDataParallel's flat all-reduce buffers (parallelize.py keeps its
                                     default gradient_as_bucket_view=False, so they are a second copy of the
                                     gradients); none in a single process
        AdamW            8 B/param   exp_avg and exp_avg_sq in float32 (the fused step allocates nothing more)
        autocast copies  2 B/param   of the cast weights only: the bf16 copy autocast makes of each weight is
                                     cached for the forward and saved by its matmul for backward, so all of
                                     them exist at the start of backward (counted throughout, an upper bound
                                     for checkpointed blocks, which drop theirs after the forward)

    Under FSDP (parallelize.shard): weights, gradients and AdamW state sharded, 16 B/param / world_size; the
    root unit's weights gathered in the compute dtype for the whole step (it is not resharded after the
    forward); two blocks' weights gathered at a time (the one computing and the one prefetched), or every
    block's without fsdp_reshard_after_forward; and, in backward, two blocks' unsharded gradients in the
    compute dtype plus their float32 copies for the reduce-scatter. No autocast copies: the mixed-precision
    policy gathers bf16 weights instead."""
    if layout.parallelism == "fsdp":
        W, a = layout.world_size, k.act
        block, root = fsdp_units(model)
        gathered_blocks = 2 * block if layout.reshard_after_forward else n_params - root
        return {"weights, gradients, AdamW state (fp32, sharded)": 4 * F32 * n_params // W,
                "gathered weights: root unit and blocks in flight": a * (root + gathered_blocks),
                "unsharded gradients of two blocks (compute dtype and fp32)": 2 * (a + F32) * block}
    memory = {"weights (fp32)": F32 * n_params, "gradients (fp32)": F32 * n_params}
    if layout.world_size > 1:
        memory["DDP gradient buckets (fp32)"] = F32 * n_params
    memory["AdamW exp_avg + exp_avg_sq (fp32)"] = 2 * F32 * n_params
    if k.autocast:
        memory["autocast bf16 weight copies"] = k.act * n_cast
    return memory


# ---- activations of one block ----------------------------------------------------------------------------------

@dataclass
class LayerActivations:
    """One block's activations for a micro-batch, in bytes. `saved`: every tensor the block keeps for backward
    (by name); `kept_selective`: what selective checkpointing keeps instead (the block input plus the outputs
    of its matmuls and attention kernels); `block_input`: what full checkpointing keeps."""

    mixer: str
    saved: dict[str, int]
    kept_selective: int
    block_input: int

    @property
    def total(self) -> int:
        return sum(self.saved.values())

    def kept(self, checkpointing: str) -> int:
        return {"none": self.total, "selective": self.kept_selective, "full": self.block_input}[checkpointing]


def norm_saved(m: ModelConfig, k: Kernels, tokens: int) -> int:
    """A pre-norm's own saved tensors beyond its input (the residual stream, counted by the block). On CUDA,
    RMSNorm runs the fused kernel (_fused_rms_norm: input and 1/rms) and LayerNorm keeps mean and 1/std;
    on CPU RMSNorm is composite and also keeps x / rms (float32, for the weight's gradient)."""
    if m.arch == "llama":
        return F32 * tokens * (1 + (m.n_embd if k.device == "cpu" else 0))
    return 2 * F32 * tokens


def mlp_saved(m: ModelConfig, k: Kernels, tokens: int) -> dict[str, int]:
    """SwiGLU (llama): c_gate's and c_fc's inputs, the gate pre-activation a (silu's input), silu(a) and c_fc's
    output (the product's operands), and the product (c_proj's input): 4 hidden-width tensors. GELU MLP (gpt2):
    c_fc's input, its output (gelu's input) and gelu's output (c_proj's input)."""
    C, hidden, a = m.n_embd, m.resolved_mlp_hidden, k.act
    if m.arch == "llama":
        return {"mlp inputs": tokens * linear_inputs(k, 2, C), "mlp hidden (4 tensors)": 4 * a * hidden * tokens}
    return {"mlp inputs": tokens * linear_inputs(k, 1, C), "mlp hidden (2 tensors)": 2 * a * hidden * tokens}


def mlp_matmul_outputs(m: ModelConfig, k: Kernels, tokens: int) -> int:
    """Selective checkpointing keeps the MLP's matmul outputs: c_gate, c_fc (llama) and c_proj."""
    hidden_outputs = 2 if m.arch == "llama" else 1
    return k.act * tokens * (hidden_outputs * m.resolved_mlp_hidden + m.n_embd)


def rope_tables(T: int, dim: int) -> int:
    """apply_rope keeps cos and sin (T, dim/2) in float32 for q and for k: 8 T dim bytes, whatever the batch."""
    return 4 * F32 * T * dim // 2


def padded(n: int, chunk: int) -> int:
    return -(-n // chunk) * chunk


def kernel_saved(kernel: str, rule, activation: str, k: Kernels, B: int, H: int, D: int, n: int) -> dict[str, int]:
    """What one attention kernel call over n positions keeps beyond q, k, v (B, H, n, D):

        flex, sdpa (flash)  the output and the float32 log-sum-exp per head and position; flex's sigmoid
                            attention (swat) also keeps the float32 output and exp(lse) that rescale it;
                            sdpa under a rule other than causal also keeps its dense (n, n) mask as a bias
        chunked (CPU)       softmax: the output and the log-sum-exp over whole chunks (ChunkedFlashCPU);
                            sigmoid: the float32 probabilities of every query chunk's key tiles (ChunkedSigmoid:
                            per position and head, the key chunks holding its edges, c keys each), no output
    """
    a, rows = k.act, B * H
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
    raise ValueError(f"no memory model for the {kernel!r} attention kernel on {k.device}: the estimate covers flex "
                     "and sdpa on CUDA (attn_backend=auto with head_dim >= 16), chunked and sdpa on CPU")


def attention_saved(mixer: Attention, m: ModelConfig, k: Kernels, B: int, T: int) -> tuple[dict[str, int], int]:
    """Attention under one or more edge rules (full, swa, block, mswa, swat, the bridges' union form) and the
    parts every attention variant shares. Per token, with a = activation bytes and C = n_embd:

        c_attn input        a C under autocast (its own cast), else the norm output (4 C)
        qkv                 3 a C: v is a view into c_attn's output, so saving v keeps all of it
        q, k after RoPE     2 a C (new tensors; without RoPE q and k are views into qkv too)
        kernel              output a C and lse 4 H (see kernel_saved)
        merged heads        a C: (B, H, T, D) -> (B, T, C) is a copy, saved by the gate or c_proj
        gate (attn_gate)    sigmoid(W y) and sigmoid(W y) * y: 2 a C
    plus RoPE's cos/sin tables (rope_tables). Returns the saved tensors and the matmul and kernel outputs
    selective checkpointing keeps."""
    C, H, D, a, tokens = m.n_embd, m.n_head, m.head_dim, k.act, B * T
    saved = {"c_attn input": tokens * linear_inputs(k, 1, C), "qkv": 3 * a * C * tokens}
    if mixer.rope_theta is not None:
        saved["q, k after RoPE"] = 2 * a * C * tokens
        saved["RoPE cos/sin tables"] = rope_tables(T, D)
    kernel_out = 0
    for rule in mixer.paths():
        kernel = resolve_backend(mixer.backend, rule, torch.device(k.device), D)
        for name, size in kernel_saved(kernel, rule, mixer.activation, k, B, H, D, T).items():
            saved[name] = saved.get(name, 0) + size
        kernel_out += a * tokens * C + F32 * B * H * T
    saved["merged heads"] = a * C * tokens
    if mixer.gate is not None:
        saved["output gate"] = 2 * a * C * tokens
    matmuls = a * tokens * (3 * C + C + (C if mixer.gate is not None else 0))
    return saved, matmuls + kernel_out


def window_path_saved(rule, k: Kernels, B: int, H: int, D: int, T: int) -> dict[str, int]:
    """The bridge path of branch fusion (attention/kernels.py: window_attention): one (R rows x K keys) tile
    per boundary window j < J, gathered by index_select and run through one masked SDPA call, then scattered
    back by index_copy, which keeps its source (the tile rows inside the sequence) for backward.

        cuda (memory-efficient SDPA)  q tiles J R D, k and v tiles 2 J K D, output J R D (per batch and head,
                                      activation bytes), lse J R (fp32), and the mask as a bias (H J R K,
                                      activation bytes, shared by the batch)
        cpu (SDPA's math path)        q and k scaled (J R D + J K D), probabilities J R K, v tiles J K D (fp32)
    """
    first_row, _, R, K = rule.window_tiles(T)
    J, a = len(first_row), k.act
    inside = int(sum(min(R, T - int(row)) for row in first_row))
    rows = B * H
    if k.device == "cuda":
        saved = {"bridge tiles q, k, v": a * rows * J * (R + 2 * K) * D, "bridge tile output": a * rows * J * R * D,
                 "bridge tile lse (fp32)": F32 * rows * J * R, "bridge tile mask as bias": a * H * J * R * K}
    else:
        saved = {"bridge tiles q, k, v (scaled)": a * rows * J * (R + 2 * K) * D,
                 "bridge tile probabilities": a * rows * J * R * K}
    saved["bridge rows scattered back"] = a * rows * inside * D
    return saved


def bridge_saved(mixer: BridgedBlockAttention, m: ModelConfig, k: Kernels, B: int, T: int):
    """Branch fusion: the block path is attention under block(b) (attention_saved's kernel terms) and the
    bridge path runs window by window (window_path_saved); the union form is plain attention under one rule."""
    if mixer.fusion == "union":
        return attention_saved(mixer, m, k, B, T)
    C, H, D, a, tokens = m.n_embd, m.n_head, m.head_dim, k.act, B * T
    saved = {"c_attn input": tokens * linear_inputs(k, 1, C), "qkv": 3 * a * C * tokens}
    if mixer.rope_theta is not None:
        saved["q, k after RoPE"] = 2 * a * C * tokens
        saved["RoPE cos/sin tables"] = rope_tables(T, D)
    kernel = resolve_backend(mixer.backend, mixer.block_rule, torch.device(k.device), D)
    saved.update(kernel_saved(kernel, mixer.block_rule, "softmax", k, B, H, D, T))
    saved.update(window_path_saved(mixer.bridge_rule, k, B, H, D, T))
    saved["merged heads"] = a * C * tokens
    if mixer.gate is not None:
        saved["output gate"] = 2 * a * C * tokens
    first_row, _, R, _ = mixer.bridge_rule.window_tiles(T)
    kernel_out = a * tokens * C + F32 * B * H * T + (a * D + F32) * B * H * len(first_row) * R
    matmuls = a * tokens * (4 * C + (C if mixer.gate is not None else 0))
    return saved, matmuls + kernel_out


def stochastic_saved(mixer: StochasticAttention, m: ModelConfig, k: Kernels, B: int, T: int):
    """sa: q, k, v are gathered into the circularly extended slot sequence of n + 2 halo positions (ToSlots,
    which keeps only the permutation), attended there as a band, and scattered back (FromSlots). So the
    kernel keeps the extended q, k, v, output and lse (ext = (n + 2 halo) / n of the plain sizes) and neither
    qkv nor the rotated q, k survive the forward; the scattered output is merged into (B, T, C) (a C).
    sa_swa adds the swa path over the shared q, k, v (which then keeps qkv and the rotated q, k), its merged
    output, and the two sigmoid gates: sigmoid(W_sa y_sa), sigmoid(W_swa y_swa) and their gated sum (3 a C).
    At lengths where every slot is inside every window (n // 2 <= halo) sa is plain causal attention."""
    C, H, D, a, tokens = m.n_embd, m.n_head, m.head_dim, k.act, B * T
    halo = stochastic_halo(mixer.window)
    permuted = T // 2 > halo
    n_ext = T + 2 * halo if permuted else T
    if permuted:
        sa_rule = PermutedWindow(torch.arange(T), mixer.window)
    else:
        sa_rule = SlidingWindow(T)
    sa_kernel = resolve_backend(mixer.backend, sa_rule, torch.device(k.device), D)
    saved = {"c_attn input": tokens * linear_inputs(k, 1, C)}
    if mixer.rope_theta is not None:
        saved["RoPE cos/sin tables"] = rope_tables(T, D)
    saved["sa q, k, v in slot order"] = 3 * a * B * H * n_ext * D
    for name, size in kernel_saved(sa_kernel, sa_rule, "softmax", k, B, H, D, n_ext).items():
        saved["sa " + name] = size
    saved["sa merged heads"] = a * C * tokens
    matmuls = a * tokens * 4 * C
    kernel_out = a * B * H * n_ext * D + F32 * B * H * n_ext
    if isinstance(mixer, GatedStochasticSlidingAttention):
        saved["qkv"] = 3 * a * C * tokens
        if mixer.rope_theta is not None:
            saved["q, k after RoPE"] = 2 * a * C * tokens
        swa_kernel = resolve_backend(mixer.backend, mixer.swa_rule, torch.device(k.device), D)
        for name, size in kernel_saved(swa_kernel, mixer.swa_rule, "softmax", k, B, H, D, T).items():
            saved["swa " + name] = size
        saved["swa merged heads"] = a * C * tokens
        saved["path gates and their sum"] = 3 * a * C * tokens
        matmuls += 2 * a * tokens * C
        kernel_out += a * tokens * C + F32 * B * H * T
    elif mixer.gate is not None:
        saved["output gate"] = 2 * a * C * tokens
        matmuls += a * tokens * C
    return saved, matmuls + kernel_out


def mlstm_saved(mixer: MLSTMLayer, m: ModelConfig, k: Kernels, B: int, T: int):
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
    C, H, a, tokens = m.n_embd, mixer.n_head, k.act, B * T  # the memory's heads (mlstm_n_head)
    dk, dv = mixer.qk_dim // H, mixer.v_head_dim
    triton = k.device == "cuda" and mixer.kernel != "native"
    saved = {"linear inputs": tokens * linear_inputs(k, 6, C),
             "gates (soft cap, fp32 i and f)": tokens * H * (2 * a + 2 * F32)}
    if triton:
        saved["triton kernel inputs q, k, v"] = a * tokens * H * (2 * dk + dv)
        saved["triton normaliser and stabiliser (fp32)"] = 2 * F32 * tokens * H
        matmuls = 0
    else:
        L = mixer.chunk
        n = padded(T, L)
        per_head = 4 * L + 6 * dk + 4 * dv + 14 + 3 * (dk * dv + dk) / L
        saved["chunkwise cell (fp32)"] = int(F32 * B * H * n * per_head)
        matmuls = int(F32 * B * H * n * (L + 2 * dv + 1 + dk * dv / L))
    saved["cell output h (fp32) and norm statistics"] = F32 * tokens * (C + 2 * H)
    saved["normed h (fp32)"] = F32 * tokens * C
    saved["h, sigmoid(o_gate) and their product"] = 3 * a * tokens * C
    linear_outputs = a * tokens * (2 * mixer.qk_dim + C + C + 2 * H + C)  # q, k, v, o_gate, i, f, c_proj
    return saved, matmuls + linear_outputs


def gated_deltanet_saved(mixer: GatedDeltaNet, m: ModelConfig, k: Kernels, B: int, T: int):
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
    Form native (chunked_gated_delta_rule, float32): normalize's input for q and k (8 C) and its statistics,
    v in float32 (4 C), then per position and head, with chunk L and head dim D: five L-wide tensors (decay,
    the within-chunk A and q k^T before and after masking), 11 D (q and k operands of the chunk matmuls,
    the normalised k, the WY solution u|w, the corrections delta, the scaled and the decayed q, the decayed
    k), 4 decay factors, and per chunk the state S (D^2)."""
    C, H, D, a, tokens = m.n_embd, m.n_head, m.head_dim, k.act, B * T
    K = mixer.conv_size
    saved = {"linear inputs": tokens * linear_inputs(k, 6, C),
             "short convolutions (inputs and outputs)": 3 * a * B * C * (T + K - 1) + 3 * a * tokens * C,
             "beta and decay (fp32)": 3 * F32 * tokens * H}
    fla = k.device == "cuda" and mixer.kernel != "native" and (k.autocast or mixer.kernel == "fla")
    if fla:
        saved["fla: normalised q, k, their norms, v, beta, decay"] = tokens * (3 * a * C + 2 * F32 * H + a * H + F32 * H)
        saved["fla: inverted chunk matrix A"] = a * tokens * H * 64
        matmuls = 0
    else:
        L = mixer.chunk
        n = padded(T, L)
        saved["normalize inputs for q, k and v in fp32"] = F32 * tokens * (3 * C + 4 * H)
        saved["chunked delta rule (fp32)"] = int(F32 * B * H * n * (5 * L + 11 * D + 4 + D * D / L))
        matmuls = int(F32 * B * H * n * (2 * L + 3 * D + D * D / L))
    saved["output norm and gate"] = tokens * (4 * F32 * C + F32 * H + 2 * a * C)
    linear_outputs = a * tokens * (5 * C + 2 * H)  # c_q, c_k, c_v, c_gate, c_proj; beta, decay
    return saved, matmuls + linear_outputs


def linear_attention_saved(mixer: TaylorLinearAttention, m: ModelConfig, k: Kernels, B: int, T: int):
    """Taylor linear attention (attention/linear.py), its chunked form. Per token: the inputs of c_qk and c_v
    (2 a C under autocast, else 4 C), RoPE's tables over the feature dimension f, the merged output (c_proj's
    input, a C). Per position and head, with F = 1 + f + f^2 features, chunk L and head dim D, in float32:
    phi(q) and phi(k) (2 F), q and k (2 f), q k^T and the masked kernel (2 L), the numerator and v copied for
    two matmuls (3 D), the denominator (1), and per chunk the states before it, S (F D) and z (F).
    The form runs inside the caller's autocast, so under bf16 autocast its matmuls cast their operands to
    bf16 one matmul at a time (phi(q) twice, v twice, q and k besides their float32 selves, the states) and
    return bf16 (q k^T, the kernel, the numerator and denominator)."""
    C, H, D, a, tokens = m.n_embd, m.n_head, m.head_dim, k.act, B * T
    f, L = mixer.feature_dim, mixer.chunk
    Fdim, n = 1 + f + f * f, padded(T, L)
    saved = {"linear inputs": tokens * linear_inputs(k, 2, C)}
    if mixer.rope_theta is not None:
        saved["RoPE cos/sin tables"] = rope_tables(T, f)
    if k.autocast:
        per_head = 3 * a * Fdim + (2 * F32 + 2 * a) * f + 2 * a * L + 3 * a * D + a + a * Fdim * (D + 1) / L
    else:
        per_head = F32 * (2 * Fdim + 2 * f + 2 * L + 3 * D + 1 + Fdim * (D + 1) / L)
    saved["chunked form"] = int(B * H * n * per_head)
    saved["merged output"] = a * tokens * C
    matmuls = int(k.act * B * H * n * (L + 2 * D + 1 + Fdim * D / L)) + a * tokens * (2 * H * f + 2 * C)
    return saved, matmuls


def moba_saved(mixer: MixtureOfBlockAttention, m: ModelConfig, k: Kernels, B: int, T: int):
    """MoBA (attention/moba.py): the gathered kernel runs each chunk of queries under activation checkpointing,
    so autograd keeps only the chunks' inputs: q (after RoPE; without RoPE a view that keeps all of qkv), the
    keys and values padded to whole blocks (copies, a C each), and the chosen block indices (int64, topk per
    head and position). The gathered keys and values of one chunk (at most 2 GATHERED_PER_CALL elements) exist
    only while that chunk runs or is recomputed, and are not counted. The dense backend is the n x n
    reference: no estimate."""
    C, H, D, a, tokens = m.n_embd, m.n_head, m.head_dim, k.act, B * T
    if mixer.kernel is not moba_gathered:
        raise ValueError("no memory model for moba's dense reference (n x n scores): use attn_backend=auto")
    saved = {"c_attn input": tokens * linear_inputs(k, 1, C)}
    if mixer.rope_theta is not None:
        saved["q after RoPE"] = a * C * tokens
        saved["RoPE cos/sin tables"] = rope_tables(T, D)
    else:
        saved["qkv"] = 3 * a * C * tokens
    saved["k, v padded to whole blocks"] = 2 * a * B * C * padded(T, mixer.block)
    saved["chosen blocks (int64)"] = 8 * B * H * T * mixer.topk
    saved["merged heads"] = a * C * tokens
    return saved, a * tokens * 5 * C  # c_attn's and c_proj's outputs, the chunks' joined output


# the estimate of each mixer family, most specific class first (sa and the bridges are MaskedAttention too)
ESTIMATES = ((StochasticAttention, stochastic_saved), (BridgedBlockAttention, bridge_saved),
             (MaskedAttention, attention_saved), (MLSTMLayer, mlstm_saved), (GatedDeltaNet, gated_deltanet_saved),
             (TaylorLinearAttention, linear_attention_saved), (MixtureOfBlockAttention, moba_saved))


def mixer_saved(mixer, m: ModelConfig, k: Kernels, B: int, T: int):
    """The mixer family's estimate (each function above derives its own)."""
    for family, saved in ESTIMATES:
        if isinstance(mixer, family):
            return saved(mixer, m, k, B, T)
    raise ValueError(f"no memory model for the {type(mixer).__name__} mixer: add one to scripts/plan_memory.py")


def block_activations(block, m: ModelConfig, k: Kernels, B: int, T: int) -> LayerActivations:
    """A block x + mixer(norm(x)), then + mlp(norm(x)): the residual stream is float32 under autocast (the
    embedding's output is, and bf16 + float32 is float32), and the two norms keep their inputs, the block
    input and the mid-block sum (2 x 4 C per token); dropout > 0 adds a 1-byte mask per dropped tensor."""
    C, tokens = m.n_embd, B * T
    saved = {"residual stream (fp32, block input and mid-block sum)": 2 * F32 * C * tokens,
             "norm statistics": 2 * norm_saved(m, k, tokens)}
    mixer, mixer_matmuls = mixer_saved(block.mixer, m, k, B, T)
    saved.update(mixer)
    saved.update(mlp_saved(m, k, tokens))
    if m.dropout > 0:
        saved["dropout masks"] = 2 * C * tokens
    block_input = F32 * C * tokens
    kept_selective = block_input + mixer_matmuls + mlp_matmul_outputs(m, k, tokens)
    return LayerActivations(type(block.mixer).__name__, saved, kept_selective, block_input)


# ---- the head: final norm, LM head, loss ------------------------------------------------------------------------

def head_saved(m: ModelConfig, k: Kernels, B: int, T: int, loss_chunk: int) -> dict[str, int]:
    """What the forward keeps after the blocks: the final norm's input (the last block's output, 4 C) and
    statistics; the token ids (embedding backward) and the targets (int64); then
        loss_chunk 0   the LM head's input (a bf16 cast, or the float32 norm output) and log_softmax's float32
                       output (B T V), which cross-entropy keeps for backward
        loss_chunk c   the norm output (float32) that each chunk's checkpoint keeps; no logits."""
    C, V, tokens = m.n_embd, m.vocab_size, B * T
    saved = {"final norm input (fp32) and statistics": F32 * C * tokens + norm_saved(m, k, tokens),
             "token ids and targets (int64)": 2 * 8 * tokens}
    if m.dropout > 0:
        saved["embedding dropout mask"] = C * tokens
    if loss_chunk:
        saved["final norm output, kept by the loss chunks"] = F32 * C * tokens
    else:
        saved["LM head input"] = tokens * linear_inputs(k, 1, C)
        saved["log-probabilities (fp32)"] = F32 * V * tokens
    return saved


def logits_transient(m: ModelConfig, k: Kernels, B: int, T: int, loss_chunk: int) -> dict[str, int]:
    """Logit memory beyond head_saved, at its two worst moments (bytes):

    loss_chunk 0, end of forward: this micro-batch's logits (a V per token) and their float32 copy (4 V,
        only under autocast), plus the previous micro-batch's logits, which train.py's `_, loss = model(...)`
        keeps bound to `_` until the next forward returns (a V).
    loss_chunk 0, loss backward: nll_loss's and log_softmax's float32 gradients (8 V) and the logits still
        bound to `_` (a V).
    loss_chunk c: one chunk of c tokens at a time: forward its logits, float32 copy and log-probabilities;
        backward the recomputed ones plus two float32 gradients and the gradient in activation dtype, and the
        LM head weight's gradient for the chunk (V C, in activation dtype and then float32) before it is
        added to .grad."""
    V, a, tokens = m.vocab_size, k.act, B * T
    copy = F32 if k.autocast else 0
    if loss_chunk:
        c = min(loss_chunk, tokens)
        head_grad = (a + copy) * V * m.n_embd
        return {"forward": c * V * (a + copy + F32), "backward": c * V * (2 * a + copy + 3 * F32) + head_grad}
    return {"forward": tokens * V * (2 * a + copy), "backward": tokens * V * (a + 2 * F32)}


# ---- a plan ----------------------------------------------------------------------------------------------------

@dataclass
class Estimate:
    """Per-GPU memory (bytes) of one training configuration at one micro-batch."""

    batch_size: int
    checkpointing: str
    loss_chunk: int
    static: dict[str, int]
    layers: list[LayerActivations]
    head: dict[str, int]
    logits: dict[str, int]
    peaks: dict[str, int] = field(default_factory=dict)

    @property
    def kept(self) -> int:
        return sum(layer.kept(self.checkpointing) for layer in self.layers)

    @property
    def activations_peak(self) -> int:
        return max(self.peaks.values())

    @property
    def total(self) -> int:
        return sum(self.static.values()) + self.activations_peak

    @property
    def peak_moment(self) -> str:
        return max(self.peaks, key=self.peaks.get)

    def breakdown(self) -> dict[str, int]:
        """The total as a sum of parts: static memory, the activations the blocks keep through the step, and
        the rest of the activations at the worst moment of the step (the head's saved tensors and the
        transients of that moment)."""
        parts = dict(self.static)
        parts[f"activations kept by the blocks ({self.checkpointing} checkpointing)"] = self.kept
        parts[f"head, loss and transients at the peak ({self.peak_moment})"] = self.activations_peak - self.kept
        return parts


def estimate(model: GPT, k: Kernels, B: int, checkpointing: str, loss_chunk: int, layout: Layout) -> Estimate:
    """The memory of a training step at micro-batch B. Activations peak at one of three moments:

        end of forward    every block's kept tensors + the head's saved + the forward logits transient
        loss backward     the same with the loss's backward transient instead
        block backward    every block's kept tensors + the logits still bound in train.py + one block's
                          backward: with checkpointing its recomputation (saved - kept) and, in every mode,
                          its gradients, taken as large as its saved activations; plus the float32 residual
                          gradient (4 C per token). The last block is the worst (all others are still kept).
    """
    m, T = model.config, model.config.block_size
    n_params, n_cast = count_parameters(model)
    layers = [block_activations(block, m, k, B, T) for block in model.blocks]
    head = head_saved(m, k, B, T, loss_chunk)
    logits = logits_transient(m, k, B, T, loss_chunk)
    e = Estimate(B, checkpointing, loss_chunk, static_memory(model, n_params, n_cast, k, layout), layers, head,
                 logits)
    kept, head_total = e.kept, sum(head.values())
    bound_logits = 0 if loss_chunk else k.act * B * T * m.vocab_size
    worst_block = max(2 * layer.total - layer.kept(checkpointing) for layer in layers)
    e.peaks = {"end of forward": kept + head_total + logits["forward"],
               "loss backward": kept + head_total + logits["backward"],
               "last block's backward": kept + bound_logits + worst_block + F32 * m.n_embd * B * T}
    return e


@dataclass
class Fit:
    checkpointing: str
    loss_chunk: int
    batch_size: int | None  # None: not even one sequence fits
    accumulation: int | None
    memory: Estimate  # at batch_size, or at batch_size 1 when nothing fits


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def largest_fit(model: GPT, k: Kernels, checkpointing: str, loss_chunk: int, sequences_per_gpu: int,
                layout: Layout, budget: float) -> Fit:
    """The largest micro-batch dividing the sequences each GPU trains on per step (so that batch_size x
    gradient_accumulation_steps stays the global batch and the accumulation divides among the GPUs) whose
    estimate fits the budget."""
    best = None
    for B in divisors(sequences_per_gpu):
        e = estimate(model, k, B, checkpointing, loss_chunk, layout)
        if e.total > budget:
            break  # memory grows with B
        best = e
    if best is None:
        return Fit(checkpointing, loss_chunk, None, None, estimate(model, k, 1, checkpointing, loss_chunk, layout))
    return Fit(checkpointing, loss_chunk, best.batch_size, sequences_per_gpu // best.batch_size * layout.world_size,
               best)


def build(cfg) -> tuple[GPT, bool]:
    """The model on the meta device (no memory): shapes and parameter counts only. Returns it and whether
    the vocabulary was assumed."""
    m = cfg.model
    assumed = m.vocab_size == 0
    m.vocab_size = m.vocab_size or DEFAULT_VOCAB
    with torch.device("meta"):
        model = GPT(m)
    return model, assumed


def kernels_for(cfg, device: str) -> Kernels:
    """bf16/fp16 autocast (2-byte activations) unless the config trains in float32; float32 on CPU."""
    if device == "cpu":
        return Kernels("cpu", F32 if cfg.train.dtype in ("auto", "float32") else 2)
    return Kernels("cuda", F32 if cfg.train.dtype == "float32" else 2)


# ---- command line -------------------------------------------------------------------------------------------------

def parse(argv) -> tuple[PlanOptions, list[str]]:
    """Split the plan's own --key=value options from the config file and its overrides."""
    options, rest = PlanOptions(), []
    own = dataclass_fields(PlanOptions)
    for arg in argv:
        key = arg[2:].partition("=")[0].replace("-", "_") if arg.startswith("--") else None
        (apply_args(options, [arg], own) if key in own else rest.append(arg))
    if not any(not arg.startswith("--") for arg in rest):
        raise ConfigError("give a config file, e.g. python scripts/plan_memory.py configs/bridges/owt_124m_full.py")
    if options.gpu_mem_gb <= 0 or options.world_size < 1 or not 0 <= options.headroom < 1:
        raise ConfigError("need gpu_mem_gb > 0, world_size >= 1 and 0 <= headroom < 1")
    if options.kernels not in ("cuda", "cpu"):
        raise ConfigError(f"kernels={options.kernels!r}: expected cuda or cpu")
    if options.compare_loss_chunk < 1:
        raise ConfigError("compare_loss_chunk must be >= 1")
    return options, rest


def plan(options: PlanOptions, config_args: list[str]) -> dict:
    """The estimate at the config's own settings, and the largest fitting micro-batch per checkpointing mode
    (with the config's loss_chunk, and with compare_loss_chunk, or 0 when the config has one), as a dict."""
    cfg = load_config(config_args)
    model, assumed_vocab = build(cfg)
    m, t = cfg.model, cfg.train
    k = kernels_for(cfg, options.kernels)
    n_params, n_cast = count_parameters(model)
    sequences = t.batch_size * t.gradient_accumulation_steps
    budget = options.gpu_mem_gb * GIB * (1 - options.headroom)
    layout = Layout(options.world_size, t.parallelism, t.fsdp_reshard_after_forward)
    configured = estimate(model, k, t.batch_size, t.activation_checkpointing, t.loss_chunk, layout)
    mixers = {}
    for block in model.blocks:
        mixers[type(block.mixer).__name__] = mixers.get(type(block.mixer).__name__, 0) + 1
    result = {
        "config": config_args, "kernels": options.kernels, "activation_bytes": k.act, "mixers": mixers,
        "vocab_size": m.vocab_size, "vocab_assumed": assumed_vocab, "n_params": n_params, "n_cast": n_cast,
        "batch_size": t.batch_size, "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "block_size": m.block_size, "global_sequences": sequences, "global_tokens": sequences * m.block_size,
        "world_size": options.world_size, "parallelism": t.parallelism, "gpu_mem_gib": options.gpu_mem_gb, "headroom": options.headroom,
        "budget_gib": budget / GIB, "configured": estimate_json(configured),
        "configured_fits": configured.total <= budget, "fits": [],
    }
    if sequences % options.world_size:
        result["error"] = (f"the global batch of {sequences} sequences does not divide among {options.world_size} "
                           "GPUs: no micro-batch keeps it there")
        result["suggested"], result["static_gib"] = None, sum(configured.static.values()) / GIB
        result["static_exceeds_budget"] = result["static_gib"] > result["budget_gib"]
        return result
    loss_chunks = sorted({t.loss_chunk, 0 if t.loss_chunk else options.compare_loss_chunk})
    for checkpointing in CHECKPOINTING:
        for loss_chunk in loss_chunks:
            fit = largest_fit(model, k, checkpointing, loss_chunk, sequences // options.world_size,
                              layout, budget)
            result["fits"].append({"activation_checkpointing": checkpointing, "loss_chunk": loss_chunk,
                                   "batch_size": fit.batch_size, "gradient_accumulation_steps": fit.accumulation,
                                   "total_gib": fit.memory.total / GIB})
    # recomputation grows from a chunked loss (the LM head again) to selective and to full checkpointing
    fitting = [fit for fit in result["fits"] if fit["batch_size"] is not None]
    result["suggested"] = min(fitting, key=lambda fit: (CHECKPOINTING.index(fit["activation_checkpointing"]),
                                                        fit["loss_chunk"] > 0), default=None)
    result["static_gib"] = sum(configured.static.values()) / GIB
    result["static_exceeds_budget"] = result["static_gib"] > result["budget_gib"]
    return result


def estimate_json(e: Estimate) -> dict:
    layers = {}
    for layer in e.layers:  # one entry per mixer type: its layers are identical
        entry = layers.setdefault(layer.mixer, {"count": 0, "saved_gib": layer.total / GIB,
                                                "kept_gib": layer.kept(e.checkpointing) / GIB,
                                                "saved": {name: size / GIB for name, size in layer.saved.items()}})
        entry["count"] += 1
    return {"batch_size": e.batch_size, "activation_checkpointing": e.checkpointing, "loss_chunk": e.loss_chunk,
            "static_gib": {name: size / GIB for name, size in e.static.items()},
            "layers": layers, "head_gib": {name: size / GIB for name, size in e.head.items()},
            "logits_transient_gib": {name: size / GIB for name, size in e.logits.items()},
            "peaks_gib": {name: size / GIB for name, size in e.peaks.items()}, "peak_moment": e.peak_moment,
            "breakdown_gib": {name: size / GIB for name, size in e.breakdown().items()}, "total_gib": e.total / GIB}


def print_plan(r: dict) -> None:
    c = r["configured"]
    mixers = ", ".join(f"{name} x {count}" for name, count in r["mixers"].items())
    vocab = " (vocab_size=0 takes the data's vocabulary: planned with 50,304)" if r["vocab_assumed"] else ""
    print(f"{' '.join(r['config'])}: {r['n_params'] / 1e9:.3f}B parameters ({r['n_cast'] / 1e9:.3f}B of them cast to "
          f"bf16 by autocast); layers {mixers}; block_size {r['block_size']:,}; vocab {r['vocab_size']:,}{vocab}")
    print(f"global batch: {r['batch_size']} x {r['gradient_accumulation_steps']} x {r['block_size']:,} = "
          f"{r['global_tokens']:,} tokens per step ({r['global_sequences']} sequences) on {r['world_size']} GPU(s) "
          f"under {r['parallelism'].upper()}")
    precision = "float32" if r["activation_bytes"] == 4 else \
        ("bf16 through FSDP's mixed-precision policy" if r["parallelism"] == "fsdp" else "bf16 autocast")
    print(f"estimate: eager PyTorch, {r['kernels']} kernels, {precision}; GiB = 2^30 bytes")
    print(f"\nmemory per GPU at batch_size={c['batch_size']}, activation_checkpointing={c['activation_checkpointing']}, "
          f"loss_chunk={c['loss_chunk']}:{'GiB':>14}")
    for name, size in c["breakdown_gib"].items():
        print(f"  {name:<72} {size:>8.2f}")
    verdict = "fits" if r["configured_fits"] else "does NOT fit"
    print(f"  {'total':<72} {c['total_gib']:>8.2f}  {verdict} in {r['budget_gib']:.1f} GiB "
          f"({r['gpu_mem_gib']:g} GiB less {100 * r['headroom']:g}% headroom)")
    print(f"activations saved for backward per layer at batch_size={c['batch_size']} (largest parts, GiB):")
    for mixer, layer in c["layers"].items():
        parts = sorted(layer["saved"].items(), key=lambda item: -item[1])[:4]
        print(f"  {mixer} x {layer['count']}: {layer['saved_gib']:.2f} each")
        print("    " + "; ".join(f"{name} {size:.2f}" for name, size in parts))
    if "error" in r:
        print(f"\n{r['error']}")
        return
    per_gpu = r["global_sequences"] // r["world_size"]
    print(f"\nlargest micro-batch that fits {r['budget_gib']:.1f} GiB and keeps the global batch "
          f"({r['global_sequences']} sequences, {per_gpu} per GPU per step):")
    print(f"  {'activation_checkpointing':<25} {'loss_chunk':>10} {'batch_size':>10} {'accumulation':>12} "
          f"{'GiB/GPU':>8}")
    for fit in r["fits"]:
        if fit["batch_size"] is None:
            print(f"  {fit['activation_checkpointing']:<25} {fit['loss_chunk']:>10} {'-':>10} {'-':>12} "
                  f"{fit['total_gib']:>8.2f}  (at batch_size 1: does not fit)")
        else:
            print(f"  {fit['activation_checkpointing']:<25} {fit['loss_chunk']:>10} {fit['batch_size']:>10} "
                  f"{fit['gradient_accumulation_steps']:>12} {fit['total_gib']:>8.2f}")
    if r["suggested"]:
        best = r["suggested"]
        print(f"suggested (the least recomputation that fits): --batch_size={best['batch_size']} "
              f"--gradient_accumulation_steps={best['gradient_accumulation_steps']} "
              f"--activation_checkpointing={best['activation_checkpointing']} --loss_chunk={best['loss_chunk']}")
    if r["static_exceeds_budget"]:
        if r["parallelism"] == "ddp":
            print(f"weights, gradients, DDP buckets, AdamW and autocast copies alone take {r['static_gib']:.1f} GiB per "
                  f"GPU, more than {r['budget_gib']:.1f}: this model cannot train under DDP (every GPU holds all of it); "
                  "shard it with --parallelism=fsdp")
        else:
            print(f"the sharded state and gathered weights alone take {r['static_gib']:.1f} GiB per GPU, more than "
                  f"{r['budget_gib']:.1f}: use more GPUs (--world_size)")


def main(argv):
    options, config_args = exit_on_config_error(parse, argv)
    result = exit_on_config_error(plan, options, config_args)
    print_plan(result)
    if options.json:
        os.makedirs(os.path.dirname(options.json) or ".", exist_ok=True)
        write_json(result, options.json)


if __name__ == "__main__":
    main(sys.argv[1:])
