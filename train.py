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

import math
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from common import machine  # first: OpenMP's wait policy is read once, when torch loads it

machine.passive_openmp()

import torch  # noqa: E402
import torch.distributed as dist

from attention import simulate_cuda
from config import Config, exit_on_config_error, load_config
from data.meta import data_identity, open_tokens
from eval.probes import training_probes
from model import GPT
from runtime.checkpoint import save_checkpoint, save_sharded_checkpoint, sharded_training_state
from training.evaluation import describe_budget, eval_budget, evaluate, isolated_rng
from training.failures import fail, write_failure
from training.metrics import StepLog
from training.rng import rng_state
from training.run_folder import RunFolder, open_run_folder
from training.schedules import get_lr, step_hooks
from training.setup import (Progress, RunData, Runtime, build_model, claim_folder, open_data, pretrained_model,
                            read_resume_checkpoint, restore, start_runtime)
from training.stop_signals import catch_stop_signals


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
            "data_identity": data_identity(data.meta),
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


def evaluate_and_log(run: Run, hooks: list) -> bool:
    """The validation loss (and the training probes when due) at this step, logged by rank 0; whether it improved
    on the best so far."""
    cfg, rt, data, folder, progress = run.cfg, run.rt, run.data, run.folder, run.progress
    t, ev, step = cfg.train, cfg.eval, progress.step
    for hook in hooks:
        hook.before_eval(run.raw_model)
    model = StepMarked(run.model) if t.cuda_graphs else run.model
    with isolated_rng(t.seed + rt.rank, rt.device):
        val_loss = evaluate(model, data.val, ev.eval_iters, rt.dp_rank, rt.dp_size, rt.autocast, rt.device,
                            t.loss_chunk, sharded=rt.fsdp, shard=rt.shard)
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
        if t.cuda_graphs:  # a new step of the CUDA graph trees: the last replay's outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        with rt.autocast:
            _, loss = model(x, y, loss_chunk=t.loss_chunk, shard=rt.shard)
        loss_sum += loss.detach()  # added now: a replay's loss is overwritten by the next one
        # under context parallelism the loss's gradient is this shard's part: the parts are summed, so the P
        # processes of a sequence scale theirs by P against DDP's mean over every process
        scaler.scale(loss * rt.cp / micro_steps).backward()
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


class StepMarked:
    """The model for evaluation with cuda_graphs: each forward a new step of the CUDA graph trees (its outputs
    overwrite the last replay's; evaluate adds each loss up before the next forward)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, *args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        return self.model(*args, **kwargs)

    def eval(self):
        return self.model.eval()

    def train(self, mode: bool = True):
        return self.model.train(mode)


def cuda_graphs_check(t, rt: Runtime) -> None:
    """cuda_graphs=True with gradient accumulation is refused (exit 2): CUDA graph trees hand the first micro-step's
    gradients to .grad in the graphs' memory, which the next micro-step's replay overwrites (pytorch/pytorch#169545).
    Where the mode does nothing, it is said."""
    micro_steps = t.gradient_accumulation_steps // rt.world_size
    if micro_steps > 1:
        fail(f"cuda_graphs=True with gradient_accumulation_steps={t.gradient_accumulation_steps} over "
             f"{rt.world_size} process(es): {micro_steps} micro-batches per step, and CUDA graph trees overwrite the "
             "gradients one micro-batch's backward left in .grad with the next one's (pytorch/pytorch#169545). Use "
             f"--gradient_accumulation_steps={rt.world_size} (one micro-batch per process) with a --batch_size "
             f"{micro_steps} times larger, or --cuda_graphs=False", status=2)
    if rt.master and rt.device.type != "cuda":
        why = ("the CPU standing in for CUDA compiles with aot_eager, which takes no mode; the steps are still marked"
               if simulate_cuda.simulated(rt.device) else f"inductor skips them on {rt.device.type}: the run trains as "
               "with --compile=True alone")
        print(f"cuda_graphs=True: no CUDA graphs here ({why})")


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
    rt = start_runtime(t, cfg.model.block_size)
    if t.cuda_graphs:
        cuda_graphs_check(t, rt)
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
    stop_signals = catch_stop_signals(rt.master, lambda: f"step {progress.step + 1}")
    stopping = False
    hooks = step_hooks(cfg)  # e.g. paper 003's window schedule
    log_step = StepLog(run)
    start_step, ckpt_interval = progress.step, t.ckpt_interval or ev.eval_interval

    # ---- the training loop ----------------------------------------------------------------------------------
    while True:
        step = progress.step
        lr = get_lr(step, t)
        for group in optimizer.param_groups:
            group["lr"] = lr
        data_changed = progress.data_change is not None and step == start_step  # the new data's first loss
        if step % ev.eval_interval == 0 or step == t.max_iters or ev.eval_only or data_changed:
            improved = evaluate_and_log(run, hooks)
            if ev.eval_only:
                break
            if improved and (step > start_step or data_changed):
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
