"""Memory planning: per-GPU memory of a training config under DDP or FSDP, and the largest micro-batch that fits
a GPU (scripts/plan_memory.py is its command line; each mixer's activations are attention/memory.py's and its
module's).

Under DDP every GPU holds the whole model, so its memory is the same on every GPU: fp32 weights, fp32
gradients, DDP's gradient buckets, AdamW's two moments, autocast's bf16 copies of the weights it casts; under
FSDP (the config's parallelism, or --parallelism=fsdp) each GPU holds 1/world_size of the weights, gradients and
AdamW state plus the bf16 weights and gradients of the units gathered at the moment (see static_memory); then the
activations of one micro-batch (batch_size sequences of block_size tokens), which are counted from the model's
own shapes (built on the meta device) and each mixer's own estimate (saved_activations, in its module under
attention/; derived from the rules for attention under edge rules): what every layer keeps for backward with
activation_checkpointing none, full and selective, plus the logits and loss. Then, for each checkpointing mode,
the largest micro-batch that fits gpu_mem_gb less the headroom, and the gradient_accumulation_steps (global,
as in the configs) that keeps the config's global batch of batch_size x gradient_accumulation_steps sequences.

The estimate is of eager PyTorch (torch.compile's partitioner usually keeps less: it fuses the casts and
recomputes cheap elementwise work) on the kernels of `--kernels`: cuda (default: FlexAttention for windowed
attention, SDPA's flash kernel for full attention, mlstm_kernels' and fla's Triton kernels for the recurrent
mixers when their *_kernel setting allows it, as requirements-gpu.txt installs them) or cpu (the chunked CPU
kernels and the built-in chunked recurrent forms: what the tests measure). Sizes are in GiB (2^30 bytes), as
torch.cuda reports them; gpu_mem_gb is in the same unit. vocab_size=0 (from the data) is planned with 50304
(GPT-2's padded vocabulary) and says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from attention.capabilities import ActivationMemory
from attention.memory import F32, Kernels, linear_inputs
from config import ModelConfig, load_config
from model import GPT

GIB = 2 ** 30
DEFAULT_VOCAB = 50304  # vocab_size = 0 takes the data's vocabulary; plan with GPT-2's, padded to 64
CHECKPOINTING = ("none", "selective", "full")


@dataclass
class PlanOptions:
    gpu_mem_gb: float = 80.0  # memory of one GPU in GiB
    world_size: int = 8  # processes, one per GPU
    headroom: float = 0.10  # fraction of gpu_mem_gb left free for the CUDA context and the allocator's slack
    kernels: str = "cuda"  # cuda (the GPU training path) | cpu (the chunked CPU kernels the tests measure)
    compare_loss_chunk: int = 2048  # the loss_chunk the table also plans when the config has none (0)
    json: str = ""  # also write the plan here


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


def block_activations(block, m: ModelConfig, k: Kernels, B: int, T: int) -> LayerActivations:
    """A block x + mixer(norm(x)), then + mlp(norm(x)): the residual stream is float32 under autocast (the
    embedding's output is, and bf16 + float32 is float32), and the two norms keep their inputs, the block
    input and the mid-block sum (2 x 4 C per token); dropout > 0 adds a 1-byte mask per dropped tensor."""
    C, tokens = m.n_embd, B * T
    saved = {"residual stream (fp32, block input and mid-block sum)": 2 * F32 * C * tokens,
             "norm statistics": 2 * norm_saved(m, k, tokens)}
    if not isinstance(block.mixer, ActivationMemory):
        raise NotImplementedError(f"{type(block.mixer).__name__} has no activation memory model: define "
                                  "saved_activations in its module (attention/capabilities.py: ActivationMemory; "
                                  "attention/memory.py has the helpers)")
    mixer, mixer_matmuls = block.mixer.saved_activations(m, k, B, T)  # the variant's own (attention/*.py)
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


