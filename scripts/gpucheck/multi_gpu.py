"""The multi_gpu step: DDP and FSDP over two GPUs against the same run in one process."""

import torch

from scripts.gpucheck.context import StepContext, outcome
from scripts.gpucheck.training import fresh_run_dir, read_losses, train_base


def step_multi_gpu(ctx: StepContext) -> dict:
    """torchrun with 2 processes (NCCL), DDP and FSDP, against the same run in one process: losses equal to
    bf16 tolerance. Two runs per parallelism, compiled: about 2 minutes. Needs two GPUs."""
    gpus = torch.cuda.device_count() if ctx.device == "cuda" else 0
    if gpus < 2:
        where = "one GPU" if gpus == 1 else "CPU (the test suite runs 2-process gloo DDP and FSDP)"
        return outcome("skipped", f"skipped: needs two or more GPUs, this machine has {where}")
    size = {**ctx.sizes["train_runs"], "max_iters": 10, "log_interval": 1}
    base = ["train.py", *train_base(ctx, size, True), "--attn_pattern=swa", "--gradient_accumulation_steps=2"]
    results, problems = {}, []
    for parallelism in ("ddp", "fsdp"):
        losses = {}
        for processes in (1, 2):
            out_dir = fresh_run_dir(ctx.out / "multi_gpu" / f"{parallelism}_{processes}")
            launcher = [ctx.python] if processes == 1 else [ctx.python, "-m", "torch.distributed.run", "--standalone",
                                                            f"--nproc_per_node={processes}"]
            done = ctx.run([*launcher, *base, f"--parallelism={parallelism}", f"--out_dir={out_dir}"],
                           f"multi_gpu_{parallelism}_{processes}")
            if done.timed_out or done.returncode != 0:
                problems.append(done.error())
                break
            losses[processes] = read_losses(out_dir)
        if len(losses) == 2:
            worst = max(abs(losses[1][s] - losses[2][s]) for s in losses[1])
            results[parallelism] = {"max_abs_difference": worst}
            if worst > 2e-2:
                problems.append(f"{parallelism}: 2 ranks differ from 1 by {worst:.2e} (tolerance 2e-2)")
    summary = "; ".join(f"{k}: 2 ranks vs 1 differ by at most {v['max_abs_difference']:.1e}" for k, v in results.items())
    if problems:
        return outcome("failed", summary or "failed", results, "\n\n".join(problems))
    return outcome("passed", summary, results)
