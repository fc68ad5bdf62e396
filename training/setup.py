"""A run's set-up, each step in its own function, in the order train.py's main() calls them: the processes, device
and precision (start_runtime), a pretrained model (pretrained_model), the data (open_data), the run folder's lock
(claim_folder), the checkpoint to resume from (read_resume_checkpoint), the model and its optimizer
(build_model), and where training stands (restore)."""

import dataclasses
import json
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from attention import simulate_cuda
from attention.ops.shard import Shard
from common.run_folder import RunFolderError
from common.run_folder import claim as claim_run_folder
from config import Config, ConfigError, process_device, resolve_device, unread_settings, validate
from data.loader import WindowSampler
from data.meta import (DataError, check_vocabulary, data_changes, data_identity, load_meta, open_tokens,
                       tokenizer_mismatch)
from data.prepare import prepare_generated_if_missing
from data.tokenizer import TokenizerUnavailable, get_tokenizer
from model import GPT
from runtime.checkpoint import (CheckpointError, checkpoint_tokenizer_identity, load_checkpoint, load_sharded_meta,
                                load_sharded_training_state)
from runtime.parallelize import parallelize
from runtime.pretrained import (GPT2_NAMES, PretrainedError, load_hf_model, load_pretrained_weights,
                                pretrained_model_config, pretrained_source)
from runtime.pretrained import tokenizer_identity as pretrained_tokenizer_identity
from runtime.wandb_run import package_problem, resolved_mode, wandb_problem
from training.evaluation import eval_budget
from training.failures import fail
from training.rng import set_rng_state


@dataclass
class Runtime:
    """The processes of this run (torchrun's environment), its device and its precision."""
    rank: int  # global, over every node
    local_rank: int  # this node's GPU
    world_size: int
    distributed: bool  # several processes (DDP, or FSDP with parallelism=fsdp)
    fsdp: bool
    device: torch.device
    dtype: torch.dtype
    autocast: object  # the forward's autocast context (nullcontext in float32 and under FSDP's own policy)
    wandb_mode: str  # the mode to log to wandb in; "" without wandb
    shard: Shard | None = None  # context parallelism: this process's shard of each sequence, and its group

    @property
    def master(self) -> bool:
        return self.rank == 0

    @property
    def cp(self) -> int:
        """Processes per sequence (context_parallel)."""
        return 1 if self.shard is None else self.shard.size

    @property
    def dp_rank(self) -> int:
        """Which data-parallel replica this process is part of: the processes of one sequence are consecutive."""
        return self.rank // self.cp

    @property
    def dp_size(self) -> int:
        return self.world_size // self.cp


def start_runtime(t, block_size: int) -> Runtime:
    """Resolve the device, check wandb, start the process group and fix the precision: a bad setting exits 2
    before anything is built or written."""
    distributed = "RANK" in os.environ  # set by torchrun
    fsdp = t.parallelism == "fsdp"
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    try:
        device_name = resolve_device(t.device)
    except ConfigError as e:
        fail(str(e), status=2)
    # WANDB_MODE=offline in the environment counts as --wandb_mode=offline; an online run needs a login and the
    # network, checked now rather than after the model is built and the run folder written
    wandb_mode = resolved_mode(t.wandb_mode)
    use_wandb = t.wandb_log and wandb_mode != "disabled"
    if use_wandb and package_problem():
        fail(f"--wandb_log=True: {package_problem()}; or train without --wandb_log", status=2)
    problem = wandb_problem(wandb_mode) if use_wandb else ""
    if problem:
        fail(f"--wandb_log=True cannot log online: {problem}. Use --wandb_mode=offline (or WANDB_MODE=offline) to log "
             "to the run folder and `wandb sync` it later, or `wandb login` first", status=2)
    device = process_device(device_name, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if distributed:
        dist.init_process_group(backend=backend)
    elif fsdp:  # FSDP shards over a process group, even one of a single process
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    shard = context_parallel_shard(t, distributed, world_size, device, block_size)
    if t.dtype == "auto":  # the CPU standing in for CUDA (attention/simulate_cuda.py) trains as a bf16 GPU does
        dtype_name = simulate_cuda.auto_dtype(device, older_gpu="float16")
    else:
        dtype_name = t.dtype
    if fsdp and dtype_name == "float16":
        fail("parallelism=fsdp trains in bfloat16 or float32, and this GPU has no bfloat16: use --dtype=float32 or "
             "--parallelism=ddp", status=2)
    if device.type == "cpu" and dtype_name == "float16" and not simulate_cuda.gpu_path(device):
        # CPU autocast in float16 with a gradient scaler: slower than float32 here and it trains worse
        fail("--dtype=float16 on the CPU: use float32 (the CPU's default) or bfloat16; float16 is for GPUs without "
             "bfloat16", status=2)
    dtype = getattr(torch, dtype_name)
    # under FSDP its mixed-precision policy computes in bf16 (parallelize.shard) instead of autocast
    autocast = nullcontext() if dtype == torch.float32 or fsdp else torch.autocast(device.type, dtype=dtype)
    torch.manual_seed(t.seed + rank)  # dropout differs per rank; data windows come from the sampler's own seed
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return Runtime(rank, local_rank, world_size, distributed, fsdp, device, dtype, autocast,
                   wandb_mode if use_wandb else "", shard)


def context_parallel_shard(t, distributed: bool, world_size: int, device, block_size: int) -> Shard | None:
    """context_parallel=P: the processes as a data parallel x context parallel mesh (DeviceMesh; the P
    processes of one sequence consecutive) and this process's shard of each sequence; None for P = 1. Refused
    (exit 2) without torchrun or when P does not divide the processes."""
    P = t.context_parallel
    if P == 1:
        return None
    if not distributed:
        fail(f"context_parallel={P} cuts each sequence over {P} processes: start them with torchrun "
             f"(torchrun --standalone --nproc_per_node={P} train.py ...), a multiple of {P} in all", status=2)
    if world_size % P:
        fail(f"context_parallel={P} with {world_size} processes: the processes form groups of {P}, one per sequence; "
             f"start a multiple of {P} (--nproc_per_node)", status=2)
    mesh = init_device_mesh(device.type, (world_size // P, P), mesh_dim_names=("dp", "cp"))
    return Shard(mesh["cp"].get_group(), mesh.get_local_rank("cp"), P, block_size)


def pretrained_model(cfg: Config, rt: Runtime):
    """init_from=gpt2 / hf:...: (the checkpoint's name, its transformers model), whose architecture replaces the
    config's; (None, None) for a model trained from scratch or resumed."""
    t, source = cfg.train, pretrained_source(cfg.train.init_from)
    if source is None:
        return None, None
    try:
        hf_model = load_hf_model(source)
        changed = pretrained_model_config(hf_model.config, cfg.model)
        validate(cfg)  # e.g. mswa's head groups against the checkpoint's head count
    except (PretrainedError, ConfigError) as e:
        fail(f"init_from={t.init_from}: {e}", status=2)
    if rt.master:
        print(f"init_from={t.init_from}: the architecture of {source}: " + (", ".join(changed) or "as configured"))
    return source, hf_model


@dataclass
class RunData:
    """The prepared data a run trains and validates on."""
    data_dir: str
    meta: dict
    tokenizer_identity: dict  # the data's tokenizer, as checkpoints record it
    train: WindowSampler
    val: WindowSampler


def open_data(cfg: Config, rt: Runtime, source) -> RunData:
    """The data folder (the generated corpora prepared on first use), checked against the model's vocabulary, a
    pretrained model's tokenizer and the loss_after marker; then the train and validation samplers."""
    m, t = cfg.model, cfg.train
    data_dir = cfg.data.data_dir or str(Path(__file__).resolve().parents[1] / "data" / cfg.data.dataset)
    try:
        if rt.master:
            prepare_generated_if_missing(data_dir)
        if rt.distributed:
            dist.barrier()
        meta = load_meta(data_dir)
        data_tokenizer = check_vocabulary(data_dir, meta)  # the identity checkpoints record
    except DataError as e:
        fail(str(e))
    if m.eot_id < 0:
        m.eot_id = meta["eot_id"]  # the token that begins a document under document_mask
    elif m.document_mask and m.eot_id != meta["eot_id"]:
        fail(f"eot_id={m.eot_id} but the end-of-text token of {data_dir} is {meta['eot_id']} (tokenizer "
             f"{meta['tokenizer']}): document_mask=True would split documents at the wrong token; leave eot_id at "
             "-1 to take the data's", status=2)
    if m.vocab_size == 0:
        m.vocab_size = -(-meta["vocab_size"] // 64) * 64  # padded to a multiple of 64 for efficient matmuls
    elif m.vocab_size < meta["vocab_size"]:
        fail(f"vocab_size={m.vocab_size} is smaller than the vocabulary of {data_dir} ({meta['vocab_size']}, "
             f"tokenizer {meta['tokenizer']}): set --vocab_size={meta['vocab_size']} or larger, or 0 to take it "
             "from the data", status=2)
    if source is not None:  # pretrained weights read the data's token ids as their own tokenizer's
        name = "gpt2" if t.init_from in GPT2_NAMES else source
        try:
            identity = pretrained_tokenizer_identity(source) or get_tokenizer(name).identity()
            problem = tokenizer_mismatch(identity, meta, data_dir, f"init_from={t.init_from}")
        except TokenizerUnavailable:  # a folder of weights without tokenizer files: only the names can be compared
            problem = ""
            if meta["tokenizer"] != name and rt.master:
                print(f"warning: {data_dir} was tokenized with {meta['tokenizer']!r} and {source} has no tokenizer "
                      f"here to compare its vocabulary with: prepare the data with --tokenizer={name} if they differ")
        if problem:
            fail(problem, status=2)
    loss_after = None
    if cfg.data.loss_after:
        try:
            marker = get_tokenizer(meta["tokenizer"]).encode(cfg.data.loss_after)
        except TokenizerUnavailable as e:
            fail(str(e))
        if len(marker) != 1:
            fail(f"loss_after={cfg.data.loss_after!r} is {len(marker)} tokens under the {meta['tokenizer']} "
                 "tokenizer: it must be exactly one token (the answer marker of the task corpus)", status=2)
        loss_after = marker[0]
        if not (open_tokens(data_dir, "val")[:1_000_000] == loss_after).any():
            fail(f"loss_after={cfg.data.loss_after!r} never occurs in {data_dir}'s validation text, so no target would "
                 "count: check the marker, or re-prepare the data (python -m data.prepare) if its format changed",
                 status=2)
    try:
        # the processes of one sequence (context parallelism) read the same windows: one data-parallel replica
        train_data = WindowSampler(data_dir, "train", m.block_size, t.batch_size, t.gradient_accumulation_steps,
                                   rt.dp_rank, rt.dp_size, seed=t.seed, device=str(rt.device), loss_after=loss_after)
        val_data = WindowSampler(data_dir, "val", m.block_size, t.batch_size, cfg.eval.eval_iters,
                                 device=str(rt.device), loss_after=loss_after)
    except ValueError as e:
        groups = (f" (under context_parallel={rt.cp} the processes count in data-parallel groups: {rt.world_size} "
                  f"processes make {rt.dp_size} groups of {rt.cp})" if rt.cp > 1 else "")
        fail(str(e) + groups, status=2)
    return RunData(data_dir, meta, data_tokenizer, train_data, val_data)


def claim_folder(out_dir: Path, t, rt: Runtime) -> None:
    """The run folder is this run's alone from here on (a lock, held until the process ends): rank 0 claims it,
    and every rank exits with its refusal rather than wait at a barrier."""
    refused = [""]
    if rt.master:
        try:
            claim_run_folder(out_dir, fresh=t.init_from != "resume", replace=t.replace_run)
        except RunFolderError as e:
            refused = [str(e)]
    if rt.distributed:
        dist.broadcast_object_list(refused, src=0)
    if refused[0]:
        fail(refused[0], status=2)


def read_resume_checkpoint(cfg: Config, rt: Runtime, data: RunData, out_dir: Path) -> dict:
    """init_from=resume: the checkpoint's metadata and state (under FSDP its metadata; the shards are read once
    the model and optimizer exist), refused when its tokenizer or model config differs from this run's."""
    m, t = cfg.model, cfg.train
    try:
        if rt.fsdp:
            ckpt = load_sharded_meta(out_dir / f"ckpt_{t.resume_from}")
        else:  # on the CPU: RNG states must stay CPU ByteTensors; load_state_dict moves the rest
            ckpt = load_checkpoint(out_dir / f"ckpt_{t.resume_from}.pt", map_location="cpu")
    except CheckpointError as e:
        other = out_dir / (f"ckpt_{t.resume_from}.pt" if rt.fsdp else f"ckpt_{t.resume_from}")
        hint = (f"; {other} exists: resume with --parallelism={'ddp' if rt.fsdp else 'fsdp'}, the run's own setting"
                if other.exists() else "")
        fail(f"cannot resume: {e}{hint}", status=1)  # a checkpoint that cannot be read: 1, as in sample, eval, export
    problem = tokenizer_mismatch(checkpoint_tokenizer_identity(ckpt), data.meta, data.data_dir,
                                 f"the run in {out_dir}")
    if problem:  # training on would relabel the run's checkpoints and compare losses of other token streams
        fail(f"cannot resume: {problem}", status=2)
    saved_identity = saved_data_identity(ckpt, out_dir)
    changes = data_changes(saved_identity, data.meta)
    if changes:  # allowed: the run's best so far is on the earlier data (restore and open_run_folder act on it)
        ckpt["data_change"] = {"changes": changes, "before": saved_identity, "after": data_identity(data.meta)}
    if changes and not t.allow_data_change:  # its losses would then continue on other text, unlabelled
        fail(f"cannot resume: the data in {data.data_dir} is not the data the run in {out_dir} trained on: "
             + "; ".join(changes) + ". Prepare it as it was, point --data_dir at the run's data, or pass "
             "--allow_data_change=True to train on regardless", status=2)
    saved = Config.from_dict(ckpt["config"]).model
    if saved.eot_id < 0:  # a checkpoint older than the setting: its end-of-text token is the data's, as resolved now
        saved.eot_id = data.meta["eot_id"]
    # a setting no layer reads is not the run's: checkpoints saved before runs kept only their own settings hold
    # every variant's, whatever values their config files gave them
    unread = unread_settings(m)
    changed = [k for k in vars(m) if k not in unread and getattr(saved, k) != getattr(m, k)]
    if changed:
        fail("the model config differs from the checkpoint's in " + ", ".join(
            f"{k} ({getattr(saved, k)!r} saved, {getattr(m, k)!r} now)" for k in changed)
            + f": resume with the run's own config: python train.py {out_dir / 'config.json'} --init_from=resume",
            status=2)
    return ckpt


def saved_data_identity(ckpt: dict, out_dir: Path) -> dict:
    """The identity of the data a run trained on: saved in its checkpoint, or (checkpoints written before that)
    the data_meta its config.json recorded when the run last started; {} when neither says."""
    if "data_identity" in ckpt:
        return ckpt["data_identity"]
    try:
        recorded = json.loads((out_dir / "config.json").read_text()).get("data_meta") or {}
    except (OSError, ValueError):
        return {}
    return data_identity(recorded) if recorded else {}


def build_model(cfg: Config, rt: Runtime, source, hf_model):
    """(the model, its parallelized form, the optimizer, the gradient scaler): the same initial weights in every
    process (FSDP shards them without a broadcast), a pretrained model's weights loaded into them, activation
    checkpointing and torch.compile per block, then DDP around the model or FSDP2 in place (runtime/parallelize.py); the
    optimizer is built after sharding, over the shards."""
    t = cfg.train
    torch.manual_seed(t.seed)
    raw_model = GPT(cfg.model).to(rt.device)
    if rt.shard is not None and raw_model.context_parallel_problems():  # a layer's own reason, beyond its class's
        fail(f"context_parallel={rt.cp}: {raw_model.context_parallel_problems()[0]}", status=2)
    if hf_model is not None:
        try:
            fresh = load_pretrained_weights(raw_model, hf_model)
        except PretrainedError as e:
            fail(f"init_from={t.init_from}: {e}", status=2)
        if rt.master:
            print(f"loaded {source}" + (f"; newly initialised: {', '.join(fresh)}" if fresh else ""))
    if rt.rank:
        torch.manual_seed(t.seed + rt.rank)  # dropout differs per rank
    try:
        model = parallelize(raw_model, t, rt.device, rt.dtype, rt.distributed, rt.local_rank)
    except ValueError as e:
        fail(f"cannot compile: {e}", status=2)
    optimizer = raw_model.configure_optimizer(t.weight_decay, t.learning_rate, (t.beta1, t.beta2), rt.device.type)
    scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16)
    return raw_model, model, optimizer, scaler


@dataclass
class Progress:
    """Where training stands: the step, the best validation loss, and the tokens trained on."""
    tokens_per_step: int
    step: int = 0
    best_val_loss: float = float("inf")
    wandb_run_id: str | None = None
    ckpt_step: int | None = None  # the step of the checkpoint this run resumed from
    tokens_seen: int = 0  # by ckpt_step: a resumed run counts on from what its checkpoint had seen
    best_budget: dict | None = None  # the evaluation that measured best_val_loss (eval_budget)
    elapsed_before: float = 0.0  # seconds the run spent in its earlier invocations (a resumed run's checkpoint)
    started: float = dataclasses.field(default_factory=time.time)  # when this invocation's training began
    data_change: dict | None = None  # a resume on other data (allow_data_change): its changes, identity before/after

    def elapsed(self) -> float:
        """Seconds of the run so far, over every invocation (what compare reports as its wall time)."""
        return self.elapsed_before + time.time() - self.started

    def tokens_at(self, at_step: int) -> int:
        """Tokens trained on by the end of step at_step, over every process and micro-step (the x-axis that lines
        up runs of different tokens per step)."""
        return self.tokens_seen + (at_step - (self.ckpt_step or 0)) * self.tokens_per_step


def restore(ckpt: dict | None, rt: Runtime, raw_model, optimizer, scaler, tokens_per_step: int) -> Progress:
    """The progress of a new run, or a resumed one's: its model, optimizer, scaler and RNG states restored (under
    FSDP every process reads its own shards, resharded if the run had another number of processes)."""
    progress = Progress(tokens_per_step)
    if ckpt is None:
        return progress
    if rt.fsdp:
        load_sharded_training_state(ckpt["path"], raw_model, optimizer)
    else:
        raw_model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
    progress.step, progress.best_val_loss = ckpt["step"], ckpt["best_val_loss"]
    # checkpoints from before the budget was recorded: their own config's (the run's last evaluation setting)
    progress.best_budget = ckpt.get("best_val_budget") or eval_budget(Config.from_dict(ckpt["config"]))
    progress.elapsed_before = ckpt.get("elapsed_s", 0.0)
    progress.wandb_run_id, progress.ckpt_step = ckpt.get("wandb_run_id"), ckpt["step"]
    # checkpoints from before tokens were counted: every step of the run had this run's tokens per step
    progress.tokens_seen = ckpt.get("tokens_seen", ckpt["step"] * tokens_per_step)
    if ckpt.get("data_change"):  # a loss on the new data is never compared with a best on the old
        progress.data_change = ckpt["data_change"]
        progress.best_val_loss, progress.best_budget = float("inf"), None
    if len(ckpt["rng"]) == rt.world_size:
        try:
            set_rng_state(ckpt["rng"][rt.rank])
        except CheckpointError as e:
            fail(f"cannot resume: {e}", status=2)
    elif rt.master:
        print(f"warning: checkpoint has RNG states for {len(ckpt['rng'])} processes, not {rt.world_size}: "
              "dropout noise will differ from the interrupted run")
    if rt.distributed:  # every process has read the checkpoint before rank 0 tidies the folder
        dist.barrier()
    return progress
