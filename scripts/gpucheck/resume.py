"""The resume step: a run killed with SIGKILL after its checkpoint and resumed must log the losses of the same
run without a break."""

import math
import re
import shlex
import signal
from pathlib import Path

from common.run_folder import read_metrics
from scripts.gpucheck.context import StepContext, outcome
from scripts.gpucheck.options import RESUME_TOLERANCE, train_runs
from scripts.gpucheck.training import fresh_run_dir, read_losses, run_options, train_base


def logged_steps(out_dir: Path) -> int:
    """The last step with a training loss in a run's metrics.jsonl (0 when none; a torn last line is skipped)."""
    try:
        return max((r["step"] for r in read_metrics(out_dir / "metrics.jsonl") if "train_loss" in r), default=0)
    except OSError:
        return 0


def step_resume(ctx: StepContext) -> dict:
    """A swax run (FlexAttention and, on CUDA, the Triton mLSTM; compiled, bf16) with a checkpoint halfway: once
    without a break, once killed with SIGKILL after the checkpoint and resumed with --init_from=resume. Three
    short runs whose kernels are in the inductor cache after train_runs: about a minute on an H100."""
    size = {**ctx.sizes["train_runs"], **ctx.sizes["resume"], "log_interval": 1}
    at, steps = size["checkpoint_at"], size["max_iters"]
    riskiest = next(iter(train_runs(size["window"])))  # a case with a GPU kernel (swax)
    args = ["train.py", *train_base(ctx, size, ctx.gpu_path), *run_options(riskiest, ctx.gpu_path, size["window"]),
            f"--ckpt_interval={at}"]
    runs = ctx.out / "resume"
    unbroken, broken = fresh_run_dir(runs / "unbroken"), fresh_run_dir(runs / "resumed")
    done = ctx.run([ctx.python, *args, f"--out_dir={unbroken}"], "resume_unbroken")
    if done.timed_out or done.returncode != 0:
        return outcome("failed", "the uninterrupted run failed", None, done.error())
    killed = ctx.run([ctx.python, *args, f"--out_dir={broken}"], "resume_killed",
                     kill_when=lambda: logged_steps(broken) >= at + 2)  # step at + 1 is logged after the checkpoint
    if killed.returncode != -signal.SIGKILL:
        return outcome("failed", "the run to kill ended before it was killed", None, killed.error())
    stopped_at = logged_steps(broken)
    if stopped_at >= steps:
        return outcome("failed", f"the run to kill logged all {steps} steps before it was killed: nothing to resume")
    done = ctx.run([ctx.python, *args, f"--out_dir={broken}", "--init_from=resume"], "resume_resumed")
    if done.timed_out or done.returncode != 0:
        return outcome("failed", f"resuming after a SIGKILL at step {stopped_at} failed", None, done.error())
    # the resumed process's own word for where it started: a check that resumed nothing must not pass
    found = re.search(r"^resumed from .+ at step (\d+) ", done.output(), re.MULTILINE)
    if found is None or not at <= int(found.group(1)) < steps:
        return outcome("failed", f"the resumed run did not resume from a checkpoint between steps {at} and {steps}",
                       None, done.error())
    at = int(found.group(1))  # a later checkpoint than the first when the kill came late
    reference, resumed = read_losses(unbroken), read_losses(broken)  # the log keeps no step after the checkpoint
    compared = sorted(set(reference) & set(resumed) - set(range(at + 1)))
    differences = [abs(resumed[s] - reference[s]) for s in compared]
    worst = max(differences, default=math.inf)
    tolerance = RESUME_TOLERANCE[ctx.device]
    results = {"checkpoint_at": at, "killed_after_step": stopped_at, "max_iters": steps, "compared_steps": compared,
               "max_abs_difference": worst, "bitwise": worst == 0.0, "tolerance": tolerance,
               "losses": {"unbroken": [reference.get(s) for s in compared], "resumed": [resumed.get(s) for s in compared]},
               "command": shlex.join(["python", *args])}
    summary = (f"killed after step {stopped_at}, resumed from the checkpoint at step {at}: steps {at + 1}-{steps} "
               f"{'equal to the bit' if worst == 0.0 else f'differ by at most {worst:.2e}'} (tolerance {tolerance:g})")
    if compared != list(range(at + 1, steps + 1)):
        return outcome("failed", f"the resumed run logged steps {compared}, expected {at + 1}-{steps}", results)
    if not worst <= tolerance:
        return outcome("failed", summary, results, "the resumed run's losses differ from the unbroken run's")
    return outcome("passed", summary, results)
