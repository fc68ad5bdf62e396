"""Pretrain a GPT whose token mixer is one of the attention variants in attention/.

Single process (CPU or one GPU):
    python train.py configs/quickstart.py [--key=value ...]
DDP (NCCL on GPUs, gloo on CPU), or FSDP2 sharding with --parallelism=fsdp (sharded checkpoint folders):
    torchrun --standalone --nproc_per_node=8 train.py configs/bridges/owt_124m_full.py
    torchrun --standalone --nproc_per_node=8 train.py configs/swax/swax_7b_stochastic.py
Resume the run in out_dir exactly where ckpt_last.pt (or the folder ckpt_last/ under FSDP) left it, or from its
best checkpoint:
    python train.py configs/quickstart.py --init_from=resume [--resume_from=best]
"""

import dataclasses
import errno
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from common import machine  # first: OpenMP's wait policy is read once, when torch loads it

machine.passive_openmp()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist

from attention import simulate_cuda
from attention.capabilities import resolved_settings as mixer_resolved_settings
from config import Config, ConfigError, exit_on_config_error, load_config, process_device, resolve_device, validate
from data.loader import WindowSampler
from data.meta import (DataError, check_vocabulary, load_meta, open_tokens, split_fingerprint, tokenizer_mismatch,
                       unigram_entropy)
from data.prepare import prepare_generated_if_missing
from data.tokenizer import TokenizerUnavailable, get_tokenizer
from eval.probes import training_probes
from model import GPT
from runtime.checkpoint import (CheckpointError, checkpoint_tokenizer_identity, keep_tokenizer, load_checkpoint,
                                load_sharded_meta, load_sharded_training_state, remove_stale_temp_files, run_info,
                                save_checkpoint, save_sharded_checkpoint, sharded_training_state)
from common.flops import peak_flops
from common.machine import openmp_note
from common.outputs import atomic_write, write_json
from runtime.parallelize import parallelize
from runtime.pretrained import (GPT2_NAMES, PretrainedError, load_hf_model, load_pretrained_weights,
                                pretrained_model_config, pretrained_source)
from runtime.pretrained import tokenizer_identity as pretrained_tokenizer_identity
from common.run_folder import RunFolderError
from common.run_folder import claim as claim_run_folder
from runtime.wandb_run import X_AXIS, package_problem, resolved_mode, start_run, wandb_problem

def schedule_warning(t) -> str:
    """A line when an explicit lr_decay_iters leaves the decay far from max_iters ("" otherwise): then much of
    training runs at min_lr, or it ends before the learning rate has decayed."""
    if not t.decay_lr or not t.lr_decay_iters or abs(t.lr_decay_iters - t.max_iters) <= 0.01 * t.max_iters:
        return ""
    if t.lr_decay_iters < t.max_iters:
        effect = (f"the learning rate reaches min_lr at step {t.lr_decay_iters} and stays there for the last "
                  f"{1 - t.lr_decay_iters / t.max_iters:.0%} of training")
    else:
        effect = f"training ends at {t.max_iters / t.lr_decay_iters:.0%} of the decay, before min_lr"
    return (f"warning: lr_decay_iters={t.lr_decay_iters} but max_iters={t.max_iters}: {effect}; set "
            f"--lr_decay_iters={t.max_iters}, or 0 to follow max_iters")


def write_failure(error: Exception, out_dir: Path, name: str, sharded: bool, saved_steps: dict) -> str:
    """The one-line error when a file of the run (a checkpoint, the log, the config) could not be written
    (checkpoint writes are atomic: the previous files are intact): why (a full disk, said as such), which
    checkpoints remain, and the command that resumes, or that starts again when there is none."""
    reasons, cause = [], error
    while cause is not None and len(reasons) < 4:
        reasons.append(getattr(cause, "strerror", None) or str(cause).splitlines()[0][:160])
        full = isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)
        if full:
            break
        cause = cause.__cause__ or cause.__context__
    try:
        free = shutil.disk_usage(out_dir).free
    except OSError:
        free = None
    full = full or (free is not None and free < 64 * 2**20)
    why = (f"the disk holding {out_dir} is full ({free / 2**20:.0f} MiB free)" if full and free is not None
           else "the disk is full" if full else f"{reasons[-1]}")
    intact = [f"{'the previous ' if name.startswith(f'ckpt_{w}') else ''}ckpt_{w}{'' if sharded else '.pt'}"
              + (f" (step {saved_steps[w]})" if w in saved_steps else "")
              for w in ("best", "last") if (out_dir / f"ckpt_{w}{'' if sharded else '.pt'}").exists()]
    resume = f"python train.py {out_dir / 'config.json'} --init_from=resume"
    if intact and not (out_dir / f"ckpt_last{'' if sharded else '.pt'}").exists():
        resume += " --resume_from=best"
    return (f"could not write {name}: {why}. " + (f"{' and '.join(intact)} {'is' if len(intact) == 1 else 'are'} "
                                                   "intact" if intact else "No checkpoint of this run exists yet")
            + (f"; free some space, then resume: {resume}" if intact else
               "; free some space, then start again with --replace_run=True (the partial run is moved aside)"))


def fail(message: str, status: int = 1):
    """Exit with a one-line error. Status 2 is a bad setting, the same on every rank of a torchrun job: only
    rank 0 says it (the others exit quietly with the same status)."""
    if status != 2 or os.environ.get("RANK", "0") == "0":
        print(f"error: {message}", file=sys.stderr)
    sys.exit(status)


def get_lr(step: int, t) -> float:
    """Linear warmup to learning_rate, then cosine decay to min_lr at lr_decay_iters (max_iters when 0), then
    min_lr."""
    if not t.decay_lr:
        return t.learning_rate
    if step < t.warmup_iters:
        return t.learning_rate * (step + 1) / (t.warmup_iters + 1)
    decay_iters = t.lr_decay_iters or t.max_iters
    if step >= decay_iters:
        return t.min_lr
    progress = (step - t.warmup_iters) / max(1, decay_iters - t.warmup_iters)
    return t.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (t.learning_rate - t.min_lr)


def window_for_step(step: int, t, long_window: int) -> int:
    """The sliding window of a training step (paper 003). stochastic: swax_short_window with probability
    swax_short_prob, else the long window, and only the long one in the last swax_anneal_frac of max_iters.
    A function of (seed, step) alone, so a resumed run draws exactly what the uninterrupted one drew."""
    if t.window_schedule == "fixed" or step >= (1 - t.swax_anneal_frac) * t.max_iters:
        return long_window
    draw = random.Random(f"{t.seed}:window:{step}").random()  # str seeds are hashed with SHA-512: stable
    return t.swax_short_window if draw < t.swax_short_prob else long_window


def rng_state() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (name, keys.tolist(), pos, has_gauss, cached),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore rng_state()'s output. Generator states must be CPU ByteTensors (torch.set_rng_state and
    torch.cuda.set_rng_state take nothing else): a checkpoint loaded onto a GPU (map_location=cuda) is refused
    with the fix instead of failing inside torch."""
    for key in ("torch", "cuda"):
        value = state.get(key)
        if value is not None and not (isinstance(value, torch.Tensor) and value.device.type == "cpu"
                                      and value.dtype == torch.uint8):
            where = f"a {value.dtype} tensor on {value.device}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise CheckpointError(f"the saved {key} RNG state is {where}, not a CPU ByteTensor: load checkpoints "
                                  "with map_location='cpu' and move only model and optimizer state to the device")
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def format_eta(seconds: float) -> str:
    seconds = int(seconds)
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class MetricsLog:
    """metrics.jsonl (always) and wandb (when enabled); only rank 0 writes."""

    def __init__(self, path: Path, wandb_run=None, on_write_error=None, tokens_at=None):
        """on_write_error(file name, OSError): what a failed write does (a full disk ends the run in one line);
        tokens_at(step): the tokens trained on by that step, which every wandb row carries (its x-axis)."""
        self.path, self.wandb_run, self.on_write_error = path, wandb_run, on_write_error
        self.tokens_at = tokens_at

    def truncate_after(self, step: int, reevaluated: bool = False) -> None:
        """On resume, drop records of steps the interrupted run logged after its last checkpoint (and, when the
        resumed run evaluates again at that step, its evaluation records there), and a last line torn by a kill
        mid-write; the log is rewritten atomically (a kill now leaves the old one or the new)."""
        if not self.path.exists():
            return
        lines = self.path.read_text(errors="replace").splitlines()
        kept = []
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if number < len(lines):  # only the last line can be cut short by a kill
                    raise ValueError(f"{self.path} line {number} is not JSON: the log is damaged; move it aside to "
                                     "resume without it") from None
                print(f"note: dropped the torn last line of {self.path} (the run was killed mid-write)")
                continue
            evaluation = "train_loss" not in record and "window" not in record  # val loss, probes
            if record["step"] < step or record["step"] == step and not (reevaluated and evaluation):
                kept.append(line)
        atomic_write(self.path, lambda f: f.write("".join(line + "\n" for line in kept).encode()))

    def log(self, step: int, **values) -> None:
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **values}) + "\n")
        except OSError as e:
            if self.on_write_error is None:
                raise
            self.on_write_error(self.path.name, e)
        if self.wandb_run is not None:
            self.wandb_run.log({**values, X_AXIS: self.tokens_at(step)}, step=step)


@contextmanager
def isolated_rng(seed: int, device):
    """Evaluation draws (sa's permutations) from its own seeded RNG: the training RNG stream is left as it
    was, so a resumed run (which re-evaluates at its first step) draws what the uninterrupted one drew, and
    every evaluation of a run uses the same draws."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def eval_budget(cfg: Config) -> dict:
    """What a validation loss is measured over: the same eval_iters batches of batch_size windows of block_size
    tokens (losses over other budgets are other numbers, not comparable to the digit)."""
    return {"eval_iters": cfg.eval.eval_iters, "batch_size": cfg.train.batch_size, "block_size": cfg.model.block_size}


def describe_budget(budget: dict) -> str:
    return f"eval_iters={budget['eval_iters']} x batch_size={budget['batch_size']} x block_size={budget['block_size']}"


@torch.no_grad()  # no autograd graph: evaluation holds one batch's activations at a time
def evaluate(model, val_data: WindowSampler, eval_iters: int, rank: int, world_size: int, autocast, device,
             loss_chunk: int = 0, sharded: bool = False):
    """Mean validation loss over a fixed set of eval_iters batches, split across ranks and averaged. A sharded
    model gathers each block's weights in every forward, a collective: every rank then runs the same number
    of forwards, those past eval_iters uncounted."""
    model.eval()
    total = torch.zeros(2, device=device, dtype=torch.float64)
    rounds = -(-eval_iters // world_size) if sharded else len(range(rank, eval_iters, world_size))
    for index in range(rank, rank + rounds * world_size, world_size):
        x, y = val_data.batch(0, min(index, eval_iters - 1))
        with autocast:
            _, loss = model(x, y, loss_chunk=loss_chunk)
        if index < eval_iters:
            total[0] += loss.detach().double()
            total[1] += 1
    if world_size > 1:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


# ---- set-up: each step in its own function, in the order main() calls them --------------------------------

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

    @property
    def master(self) -> bool:
        return self.rank == 0


def start_runtime(t) -> Runtime:
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
    if t.dtype == "auto":  # the CPU standing in for CUDA (attention/simulate_cuda.py) trains as a bf16 GPU does
        dtype_name = simulate_cuda.auto_dtype(device, older_gpu="float16")
    else:
        dtype_name = t.dtype
    if fsdp and dtype_name == "float16":
        fail("parallelism=fsdp trains in bfloat16 or float32, and this GPU has no bfloat16: use --dtype=float32 or "
             "--parallelism=ddp", status=2)
    dtype = getattr(torch, dtype_name)
    # under FSDP its mixed-precision policy computes in bf16 (parallelize.shard) instead of autocast
    autocast = nullcontext() if dtype == torch.float32 or fsdp else torch.autocast(device.type, dtype=dtype)
    torch.manual_seed(t.seed + rank)  # dropout differs per rank; data windows come from the sampler's own seed
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return Runtime(rank, local_rank, world_size, distributed, fsdp, device, dtype, autocast,
                   wandb_mode if use_wandb else "")


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
    data_dir = cfg.data.data_dir or str(Path(__file__).resolve().parent / "data" / cfg.data.dataset)
    try:
        if rt.master:
            prepare_generated_if_missing(data_dir)
        if rt.distributed:
            dist.barrier()
        meta = load_meta(data_dir)
        data_tokenizer = check_vocabulary(data_dir, meta)  # the identity checkpoints record
    except DataError as e:
        fail(str(e))
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
        train_data = WindowSampler(data_dir, "train", m.block_size, t.batch_size, t.gradient_accumulation_steps,
                                   rt.rank, rt.world_size, seed=t.seed, device=str(rt.device), loss_after=loss_after)
        val_data = WindowSampler(data_dir, "val", m.block_size, t.batch_size, cfg.eval.eval_iters,
                                 device=str(rt.device), loss_after=loss_after)
    except ValueError as e:
        fail(str(e), status=2)
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
        fail(f"cannot resume: {e}{hint}", status=2)
    problem = tokenizer_mismatch(checkpoint_tokenizer_identity(ckpt), data.meta, data.data_dir,
                                 f"the run in {out_dir}")
    if problem:  # training on would relabel the run's checkpoints and compare losses of other token streams
        fail(f"cannot resume: {problem}", status=2)
    saved = Config.from_dict(ckpt["config"]).model
    changed = [k for k in vars(m) if getattr(saved, k) != getattr(m, k)]
    if changed:
        fail("the model config differs from the checkpoint's in " + ", ".join(
            f"{k} ({getattr(saved, k)!r} saved, {getattr(m, k)!r} now)" for k in changed)
            + f": resume with the run's own config: python train.py {out_dir / 'config.json'} --init_from=resume",
            status=2)
    return ckpt


def build_model(cfg: Config, rt: Runtime, source, hf_model):
    """(the model, its parallelized form, the optimizer, the gradient scaler): the same initial weights in every
    process (FSDP shards them without a broadcast), a pretrained model's weights loaded into them, activation
    checkpointing and torch.compile per block, then DDP around the model or FSDP2 in place (runtime/parallelize.py); the
    optimizer is built after sharding, over the shards."""
    t = cfg.train
    torch.manual_seed(t.seed)
    raw_model = GPT(cfg.model).to(rt.device)
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


class RunFolder:
    """The run folder's files: config.json, metrics.jsonl (and wandb), the checkpoints written so far. Rank 0
    writes them; a failed write ends the run with one line saying what is intact."""

    def __init__(self, out_dir: Path, fsdp: bool, saved_steps: dict):
        self.out_dir, self.fsdp, self.saved_steps = out_dir, fsdp, saved_steps  # saved: checkpoint -> its step
        self.metrics, self.info, self.unigram = None, None, None

    def cannot_write(self, name: str, error: OSError):
        fail(write_failure(error, self.out_dir, name, self.fsdp, self.saved_steps))


def resolved_settings(cfg: Config, rt: Runtime, raw_model) -> dict:
    """What the run's "auto" settings became here (the device, the dtype, the positions, each layer's kernels:
    attention/capabilities.py resolved_settings), for config.json: compare shows what ran, not "auto"."""
    values = {"device": str(rt.device), "dtype": str(rt.dtype).removeprefix("torch."),
              "pos_embedding": cfg.model.resolved_pos_embedding}
    per_setting: dict = {}
    for block in raw_model.blocks:
        for key, value in mixer_resolved_settings(block.mixer, cfg.model.block_size, rt.device, rt.dtype).items():
            per_setting.setdefault(key, [])
            if value not in per_setting[key]:
                per_setting[key].append(value)
    values.update({key: "+".join(map(str, found)) for key, found in per_setting.items()})
    return values


def run_invocations(path: Path, cfg: Config, info: dict, progress: Progress) -> list[dict]:
    """Every invocation of the run, in order, as config.json keeps them: each one's command, code version and
    start (run_info), the step it started from, and the settings it changed from the one before (a resume may
    raise max_iters or change eval_iters). A fresh run starts the list; a resumed one appends to it."""
    earlier, before = [], {}
    if progress.ckpt_step is not None and path.exists():
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            old = {}
        earlier = old.get("invocations") or ([{**old["run"], "from_step": 0}] if "run" in old else [])
        before = {section: old.get(section, {}) for section in ("model", "data", "train", "eval")}
    now = cfg.to_dict()
    changed = {f"{section}.{key}": [before[section].get(key), value]
               for section in before for key, value in now.get(section, {}).items()
               if key in before[section] and before[section][key] != value}
    entry = {**info, "from_step": progress.step}
    if changed:
        entry["changed"] = changed
    return [*earlier, entry]


def open_run_folder(cfg: Config, rt: Runtime, data: RunData, raw_model, progress: Progress, argv) -> RunFolder:
    """Rank 0 writes the resolved config (with the data's meta) and says what is trained on what, starts the
    wandb run and opens metrics.jsonl (on resume, dropping what was logged after the checkpoint)."""
    m, t, ev = cfg.model, cfg.train, cfg.eval
    folder = RunFolder(Path(t.out_dir), rt.fsdp, {t.resume_from: progress.step} if progress.ckpt_step is not None
                       else {})
    if not rt.master:
        return folder
    out_dir, meta = folder.out_dir, data.meta
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(out_dir)
    folder.info = info = run_info(rt.world_size)
    invocations = run_invocations(out_dir / "config.json", cfg, info, progress)
    folder.unigram = unigram = unigram_entropy(open_tokens(data.data_dir, "val")[:10_000_000], meta["vocab_size"])
    try:
        write_json({**cfg.to_dict(), "run": info, "invocations": invocations,
                    "resolved": resolved_settings(cfg, rt, raw_model),
                    "data_meta": {**meta, "unigram_entropy": unigram,
                                                               "val_sha256": split_fingerprint(data.data_dir)}},
                   out_dir / "config.json")
    except OSError as e:
        folder.cannot_write("config.json", e)
    try:  # the run keeps its own tokenizer: sampling, evaluation and export need nothing outside the folder
        keep_tokenizer(meta["tokenizer"], out_dir)
    except OSError as e:
        folder.cannot_write("tokenizer.json", e)
    except TokenizerUnavailable as e:
        print(f"warning: the run keeps no copy of its tokenizer ({str(e).splitlines()[0]}): sampling and evaluation "
              f"will need {meta['tokenizer']!r} where it is now")
    n_params = raw_model.num_params()
    print(f"model: {m.arch}, {m.n_layer} layers x {m.n_head} heads x {m.n_embd}, mixers {m.attn_pattern!r}: "
          f"{n_params / 1e6:.2f}M parameters ({raw_model.num_params(exclude_embeddings=True) / 1e6:.2f}M "
          "without embeddings)")
    layers_of = {}  # e.g. per-head windows of multi-scale variants; layers alike are said once
    for i, block in enumerate(raw_model.blocks):
        if block.mixer.describe():
            layers_of.setdefault(block.mixer.describe(), []).append(str(i))
    for description, layers in layers_of.items():
        print(f"  layer{'s' if len(layers) > 1 else ''} {', '.join(layers)}: {description}")
    print(f"data: {data.data_dir} ({meta['tokenizer']} tokenizer, {meta['train_tokens']:,} train / "
          f"{meta['val_tokens']:,} val tokens); {progress.tokens_per_step:,} tokens per step; "
          f"{rt.world_size} process(es) on {rt.device}, {str(rt.dtype).removeprefix('torch.')}")
    print(f"unigram baseline (val token entropy): {unigram:.4f} nats")
    if schedule_warning(t):
        print(schedule_warning(t))
    if rt.device.type == "cpu":
        print(openmp_note())
    wandb_run = None
    if rt.wandb_mode:
        try:
            wandb_run = start_run(cfg, out_dir, argv, rt.wandb_mode, progress.wandb_run_id,
                                  resuming=progress.ckpt_step is not None, run=info, n_params=n_params)
        except OSError as e:
            folder.cannot_write("wandb.json", e)
        progress.wandb_run_id = wandb_run.id
        print(f"wandb: run {wandb_run.id} ({rt.wandb_mode}) in group {wandb_run.group!r}, tags "
              f"{', '.join(wandb_run.tags) or 'none'}; metrics against {X_AXIS} ({progress.tokens_per_step:,} per "
              "step)")
    folder.metrics = MetricsLog(out_dir / "metrics.jsonl", wandb_run, on_write_error=folder.cannot_write,
                                tokens_at=progress.tokens_at)
    step = progress.step
    if step > 0:
        try:  # the evaluation at the resumed step runs again (in the loop): its earlier records are dropped
            folder.metrics.truncate_after(step, reevaluated=step % ev.eval_interval == 0 or step == t.max_iters
                                          or ev.eval_only)
        except ValueError as e:
            fail(str(e))
        except OSError as e:
            folder.cannot_write("metrics.jsonl", e)
        print(f"resumed from {out_dir / (f'ckpt_{t.resume_from}' + ('' if rt.fsdp else '.pt'))} at step {step} "
              f"(best val loss {progress.best_val_loss:.4f})")
        if progress.best_budget not in (None, eval_budget(cfg)):
            print(f"note: that best val loss was measured with {describe_budget(progress.best_budget)}; this run "
                  f"evaluates with {describe_budget(eval_budget(cfg))}, another number over other windows: until a "
                  "loss of this run beats it, every line says which budget the best comes from")
    elif (out_dir / "metrics.jsonl").exists():
        (out_dir / "metrics.jsonl").unlink()  # a resume from step 0: its log starts again
    return folder


def catch_stop_signals() -> list:
    """SIGTERM and SIGINT ask the run to stop: their numbers are collected here and acted on once all ranks agree
    (the all-reduce of each step), after a checkpoint. A second signal stops at once."""
    received = []

    def request_stop(signum, frame):
        received.append(signum)
        signal.signal(signum, signal.SIG_DFL)

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    return received


# ---- the loop's steps ---------------------------------------------------------------------------------------

@dataclass
class Run:
    """What the set-up built, as the loop's steps share it: the config, the processes, the data, the run folder,
    the model and the optimizer that train it, and where training stands."""
    cfg: Config
    rt: Runtime
    data: RunData
    folder: RunFolder
    raw_model: GPT  # the model's own parameters and methods (checkpoints, hooks, probes)
    model: torch.nn.Module  # what trains and evaluates: DDP around raw_model under torchrun, else raw_model itself
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    progress: Progress


def save(run: Run, which: str) -> None:
    """Checkpoint ckpt_{which} (every rank takes part: RNG states are gathered): one file written by rank 0 under
    DDP, a folder of every rank's shards under FSDP."""
    cfg, rt, data, folder, progress = run.cfg, run.rt, run.data, run.folder, run.progress
    raw_model, optimizer = run.raw_model, run.optimizer
    states = [None] * rt.world_size
    if rt.distributed:
        dist.all_gather_object(states, rng_state())
    else:
        states = [rng_state()]
    step = progress.step
    meta = {"config": cfg.to_dict(), "step": step, "best_val_loss": progress.best_val_loss,
            "best_val_budget": progress.best_budget, "elapsed_s": progress.elapsed(), "rng": states,
            "data_cursor": data.train.state_dict(step), "wandb_run_id": progress.wandb_run_id,
            "tokens_seen": progress.tokens_at(step),
            "tokenizer": data.meta["tokenizer"], "tokenizer_identity": data.tokenizer_identity,
            **({"run": folder.info} if rt.master else {})}
    out_dir = folder.out_dir
    try:
        if rt.fsdp:
            save_sharded_checkpoint(out_dir / f"ckpt_{which}", sharded_training_state(raw_model, optimizer),
                                    meta, rt.rank)
        elif rt.master:
            save_checkpoint({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                             "scaler": run.scaler.state_dict(), **meta}, out_dir / f"ckpt_{which}.pt")
    except (OSError, RuntimeError) as e:  # a full disk, a quota: the writes are atomic, nothing is half-written
        fail(write_failure(e, out_dir, f"ckpt_{which}" + ("" if rt.fsdp else ".pt"), rt.fsdp, folder.saved_steps))
    folder.saved_steps[which] = step


class WindowSchedule:
    """Paper 003's stochastic window training, as a per-step hook of the loop: each step trains with the window
    window_for_step draws (a function of seed and step), evaluation uses the long (test-time) window, and every
    step's window is logged. Only the layers' edge rule changes (attention/local.py)."""

    def __init__(self, t, long_window: int):
        self.t, self.long_window = t, long_window

    def before_eval(self, model) -> None:
        model.set_window(self.long_window)

    def before_step(self, step: int, model) -> dict:
        window = window_for_step(step, self.t, self.long_window)
        model.set_window(window)
        return {"window": window}


def step_hooks(cfg: Config) -> list:
    """What changes the model from step to step (before_eval(model), before_step(step, model) -> values logged
    with the step): the window schedule."""
    return [WindowSchedule(cfg.train, cfg.model.swa_window)] if cfg.train.window_schedule != "fixed" else []


def evaluate_and_log(run: Run, hooks: list) -> bool:
    """The validation loss (and the training probes when due) at this step, logged by rank 0; whether it improved
    on the best so far."""
    cfg, rt, data, folder, progress = run.cfg, run.rt, run.data, run.folder, run.progress
    t, ev, step = cfg.train, cfg.eval, progress.step
    for hook in hooks:
        hook.before_eval(run.raw_model)
    with isolated_rng(t.seed + rt.rank, rt.device):
        val_loss = evaluate(run.model, data.val, ev.eval_iters, rt.rank, rt.world_size, rt.autocast, rt.device,
                            t.loss_chunk, sharded=rt.fsdp)
        improved = val_loss < progress.best_val_loss
        budget = eval_budget(cfg)
        if improved:
            progress.best_val_loss, progress.best_budget = val_loss, budget
        other = progress.best_budget not in (None, budget)  # a resumed run's best, measured over another budget
        if rt.master:
            print(f"step {step}: val loss {val_loss:.4f} (unigram baseline {folder.unigram:.4f}, best "
                  f"{progress.best_val_loss:.4f}" + (f", measured before the resume with "
                                                      f"{describe_budget(progress.best_budget)}, not this run's "
                                                      f"{describe_budget(budget)}" if other else "") + ")")
            folder.metrics.log(step, val_loss=val_loss, best_val_loss=progress.best_val_loss,
                               **({"best_val_budget": progress.best_budget} if other else {}))
        if ev.eval_tasks and step % (ev.eval_tasks_interval or ev.eval_interval) == 0:
            # retrieval / perplexity probes at several lengths (eval/probes.py) on rank 0, or on every rank of a
            # sharded model (its forwards are collectives; they draw the same probes). Run eagerly: compiled
            # blocks would recompile for every length and batch width (attention itself still runs compiled
            # FlexAttention on GPUs, one kernel per padded length)
            lengths = [int(x) for x in ev.eval_task_lengths.split(",") if x.strip()] or [cfg.model.block_size]
            if rt.master or rt.fsdp:
                with rt.autocast, torch.compiler.set_stance("force_eager"):
                    probes = training_probes(run.raw_model, ev.eval_tasks.split(","), lengths,
                                             open_tokens(data.data_dir, "val"), data.meta["eot_id"],
                                             data.meta["tokenizer"], t.seed, rt.device)
            if rt.master:
                print(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in probes.items()))
                folder.metrics.log(step, **probes)
            if rt.distributed:
                dist.barrier()
    return improved


def train_step(run: Run, stop_signals: list) -> tuple[float, bool]:
    """One optimizer step over the local micro-batches (gradients synchronised on the last one only); returns the
    mean training loss over ranks and whether any rank was asked to stop. A loss that is not finite ends the run
    without saving."""
    rt, data, model, optimizer, scaler = run.rt, run.data, run.model, run.optimizer, run.scaler
    t, step = run.cfg.train, run.progress.step
    micro_steps = data.train.local_micro_steps
    loss_sum = torch.zeros((), device=rt.device)
    for micro_step in range(micro_steps):
        x, y = data.train.get(step, micro_step)
        if rt.fsdp:  # gradients are reduce-scattered only on the last micro-step
            run.raw_model.set_requires_gradient_sync(micro_step == micro_steps - 1)
        elif rt.distributed:  # gradients are all-reduced only on the last micro-step
            model.require_backward_grad_sync = micro_step == micro_steps - 1
        with rt.autocast:
            _, loss = model(x, y, loss_chunk=t.loss_chunk)
        loss_sum += loss.detach()
        scaler.scale(loss / micro_steps).backward()
    # one small collective per step: the mean loss over ranks, and whether any rank was told to stop
    status = torch.stack([loss_sum / micro_steps, torch.tensor(float(bool(stop_signals)), device=rt.device)])
    if rt.distributed:
        dist.all_reduce(status)
    train_loss, stopping = status[0].item() / rt.world_size, status[1].item() > 0
    if not math.isfinite(train_loss):
        out_dir = run.folder.out_dir
        saved = [p.name for p in sorted(out_dir.glob("ckpt_*")) if not p.name.startswith(".")]
        kept = (f"the checkpoints in {out_dir} ({', '.join(saved)}) are from the last good step" if saved
                else "no checkpoint was written before it")
        fix = "use --dtype=bfloat16 or float32 instead of float16, " if rt.dtype == torch.float16 else ""
        fail(f"the training loss is {train_loss} at step {step}: stopping without saving; {kept}. Lower "
             f"learning_rate, {fix}or check the data")
    if t.grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return train_loss, stopping


class StepLog:
    """The log line and metrics of every log_interval-th step: loss, learning rate, tokens/s, the hooks'
    values, MFU against the device's peak, peak GPU memory, time per step and the time left."""

    def __init__(self, run: Run):
        # not the Run itself: main drops the DDP model before closing the process group (close_process_group)
        self.t, self.rt, self.folder, self.progress = run.cfg.train, run.rt, run.folder, run.progress
        self.tokens_per_step = run.progress.tokens_per_step
        self.flops_per_token = run.raw_model.flops_per_token(run.cfg.model.block_size)
        self.peak = peak_flops(run.rt.device, run.rt.dtype)
        self.start_step, self.t_start, self.t_last = run.progress.step, time.time(), time.time()

    def __call__(self, step: int, train_loss: float, lr: float, hooked: dict) -> None:
        t, rt = self.t, self.rt
        now = time.time()
        dt = (now - self.t_last) / (step - max(self.start_step, step - t.log_interval) or 1)
        self.t_last = now
        tokens_per_s = self.tokens_per_step / dt
        values = {"train_loss": train_loss, "lr": lr, "tokens_per_s": tokens_per_s,
                  "elapsed_s": round(self.progress.elapsed(), 2)}
        line = f"step {step}/{t.max_iters} | loss {train_loss:.4f} | lr {lr:.2e} | {tokens_per_s / 1e3:.1f}k tok/s"
        line += "".join(f" | {key} {value}" for key, value in hooked.items())
        if self.peak is not None:
            values["mfu"] = self.flops_per_token * tokens_per_s / (self.peak * rt.world_size)
            line += f" | mfu {100 * values['mfu']:.1f}%"
        if rt.device.type == "cuda":  # the most this process's tensors have held so far (rank 0's GPU)
            values["max_memory_gib"] = torch.cuda.max_memory_allocated(rt.device) / 2**30
            line += f" | {values['max_memory_gib']:.1f} GiB"
        elapsed_per_step = (now - self.t_start) / (step - self.start_step)
        line += f" | {1000 * dt:.0f} ms/step | eta {format_eta(elapsed_per_step * (t.max_iters - step))}"
        print(line, flush=True)
        self.folder.metrics.log(step, **values)


def finish(run: Run, stopping: bool, signum: int) -> None:
    """Say how the run ended (stopped by a signal, done with its checkpoints, or nothing trained) and close wandb."""
    rt, folder, progress, t = run.rt, run.folder, run.progress, run.cfg.train
    if not rt.master:
        return
    step, saved_steps = progress.step, folder.saved_steps
    if stopping and step < t.max_iters:
        print(f"stopped by signal {signum} at step {step}; {'ckpt_last' if rt.fsdp else 'ckpt_last.pt'} saved. "
              "Resume with the same command plus --init_from=resume")
    elif saved_steps:
        print(f"done: best val loss {progress.best_val_loss:.4f} vs unigram baseline {folder.unigram:.4f}; checkpoints "
              f"in {folder.out_dir}: " + ", ".join(f"ckpt_{w} (step {saved_steps[w]})" for w in sorted(saved_steps)))
    else:  # max_iters=0, or an evaluation-only pass: nothing trained, nothing saved
        print(f"done: val loss {progress.best_val_loss:.4f} vs unigram baseline {folder.unigram:.4f} at step {step}; "
              f"no checkpoint written (nothing was trained: max_iters={t.max_iters})")
    if folder.metrics.wandb_run is not None:
        folder.metrics.wandb_run.finish()


def close_process_group() -> None:
    """The process group's end. Its caller first drops the DDP model, whose reducer holds the group: the group is
    then destroyed here, inside destroy_process_group (which releases the GIL), and not when main's locals are
    freed (with the GIL held, while gloo's worker thread may need it to free a finished collective's tensors: a
    deadlock)."""
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- the run ------------------------------------------------------------------------------------------------

def main(argv):
    cfg: Config = exit_on_config_error(load_config, argv)  # any error here exits 2 before anything is written
    t, ev = cfg.train, cfg.eval
    rt = start_runtime(t)
    source, hf_model = pretrained_model(cfg, rt)  # init_from=gpt2 / hf:...: its architecture replaces the config's
    data = open_data(cfg, rt, source)
    claim_folder(Path(t.out_dir), t, rt)
    ckpt = read_resume_checkpoint(cfg, rt, data, Path(t.out_dir)) if t.init_from == "resume" else None
    raw_model, model, optimizer, scaler = build_model(cfg, rt, source, hf_model)
    del hf_model
    progress = restore(ckpt, rt, raw_model, optimizer, scaler,
                       t.batch_size * t.gradient_accumulation_steps * cfg.model.block_size)
    del ckpt
    if progress.step >= t.max_iters and not ev.eval_only and progress.ckpt_step is not None:
        if rt.master:  # nothing to train: the finished run's logs stay as they are
            print(f"{Path(t.out_dir)} already finished at step {progress.step} (max_iters={t.max_iters}): nothing to "
                  "do; raise --max_iters to train further")
        del model  # DDP's reducer first (close_process_group)
        return close_process_group()
    folder = open_run_folder(cfg, rt, data, raw_model, progress, argv)
    run = Run(cfg, rt, data, folder, raw_model, model, optimizer, scaler, progress)
    stop_signals, stopping = catch_stop_signals(), False
    hooks = step_hooks(cfg)  # e.g. paper 003's window schedule
    log_step = StepLog(run)
    start_step, ckpt_interval = progress.step, t.ckpt_interval or ev.eval_interval

    # ---- the training loop ----------------------------------------------------------------------------------
    while True:
        step = progress.step
        lr = get_lr(step, t)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if step % ev.eval_interval == 0 or step == t.max_iters or ev.eval_only:
            improved = evaluate_and_log(run, hooks)
            if ev.eval_only:
                break
            if improved and step > start_step:
                save(run, "best")
        if step > start_step and (step % ckpt_interval == 0 or step == t.max_iters or stopping):
            save(run, "last")
        if step >= t.max_iters or stopping:
            break
        hooked = {}  # what the hooks set for this step (the window), logged with it
        for hook in hooks:
            hooked.update(hook.before_step(step, raw_model))
        train_loss, stopping = train_step(run, stop_signals)
        progress.step = step = step + 1
        if rt.master and hooked:
            folder.metrics.log(step, **hooked)  # every step's values, under the step number its loss is logged with
        if rt.master and (step % t.log_interval == 0 or step == t.max_iters):
            log_step(step, train_loss, lr, hooked)

    signum = stop_signals[0] if stop_signals else signal.SIGTERM  # another rank may have received it
    finish(run, stopping, signum)
    del run, model  # DDP's reducer first (close_process_group)
    close_process_group()
    if stopping and progress.step < t.max_iters:
        sys.exit(128 + signum)


if __name__ == "__main__":
    main(sys.argv[1:])
