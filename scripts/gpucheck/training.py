"""The train_runs step: a short training run per mixer family and GPU setting; and what the other steps that train
share with it (train.py's arguments, a run's fresh folder, what its metrics say)."""

import math
import shlex
import shutil
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from attention.registry import pattern_names
from common.run_folder import read_metrics
from data.prepare import prepare_generated_if_missing
from scripts.gpucheck.context import StepContext, outcome
from scripts.gpucheck.options import REPO, cuda_only_runs, gpu_kernel_mixers, grid_runs, train_runs
from scripts.gpucheck.processes import stopping


def train_base(ctx: StepContext, size: dict, compile_: bool) -> list[str]:
    """train.py's arguments shared by the short runs: the quickstart corpus, a 2-layer llama-style model."""
    prepare_generated_if_missing(str(REPO / "data" / "embedded_byte"))  # once, before runs that may start together
    return ["configs/quickstart.py", "--arch=llama", "--bias=False", "--n_layer=2", f"--n_head={size['n_head']}",
            f"--n_embd={size['n_embd']}", f"--block_size={size['block_size']}", f"--batch_size={size['batch_size']}",
            "--gradient_accumulation_steps=1", f"--max_iters={size['max_iters']}",
            f"--warmup_iters={max(1, size['max_iters'] // 5)}", f"--lr_decay_iters={size['max_iters']}",
            f"--eval_interval={size['max_iters']}", f"--eval_iters={size['eval_iters']}",
            f"--log_interval={size['log_interval']}", f"--compile={compile_}", f"--device={ctx.device}"]


def run_options(name: str, gpu_path: bool, window: int) -> list[str]:
    """A training run's options (train_runs), and on CUDA's path the GPU kernel of each of its mixers that has
    one (the mixer's gpu_kernel): a run that cannot use it fails instead of training with the built-in form."""
    options = train_runs(window)[name]
    if gpu_path:
        pattern = next(o.partition("=")[2] for o in options if o.startswith("--attn_pattern="))
        kernels = gpu_kernel_mixers()
        options = options + [f"--{kernels[m][0]}={kernels[m][1]}" for m in sorted(set(pattern_names(pattern)))
                             if m in kernels]
    return options


def kernel_use_problem(options: list[str], log: str) -> str:
    """Why a run's log does not show the GPU kernels its options asked for in use ("" when it does): each layer's
    start-up line (train.py prints Mixer.describe()) names the kernel it runs."""
    for mixer, (setting, value, _, shown) in gpu_kernel_mixers().items():
        if f"--{setting}={value}" in options and shown not in log:
            return f"--{setting}={value} was given but no {mixer} layer reports '{shown}' in the log"
    return ""


def fresh_run_dir(path: Path) -> Path:
    """The run folder of one of the check's runs, emptied: a rerun of the check starts that run afresh."""
    shutil.rmtree(path, ignore_errors=True)
    return path


def step_train_runs(ctx: StepContext) -> dict:
    """A 30-step run per mixer family and per GPU setting, ctx.jobs at a time. On an H100 each is process start
    and CUDA init (~8 s), compiling its block graphs for training and for evaluation (~15-40 s, CPU-bound, so
    several runs compile at once; kernels shared with earlier runs come from the inductor cache; mswa has four
    windows, so four graphs) and 30 steps of 8 x 1024 tokens through 2 layers (~2 s): one run per registry case
    and per GPU setting (27 today), 4 at a time, in about 5-6 minutes. Their tokens/s are measured beside the other runs (bench_train measures throughput)."""
    size = ctx.sizes["train_runs"]
    # on the CPU compiling 20 models takes longer than the whole check should, unless it stands in for CUDA
    compile_ = ctx.gpu_path
    base = train_base(ctx, size, compile_)
    cuda_only = cuda_only_runs(size["window"])
    all_runs = {name: train_runs(size["window"])[name] for name in grid_runs(size, ctx.cfg.runs)}
    names = [name for name in all_runs if ctx.gpu_path or name not in cuda_only]
    runs = {name: {"mixer": name, "status": "not applicable", "error": "", "options": " ".join(all_runs[name]),
                   "note": f"on CPU: {reason}"} for name, reason in cuda_only.items()
            if name in all_runs and name not in names}

    def train(name: str) -> dict:
        if ctx.remaining() < 5 or stopping.is_set():
            reason = "the check was stopped" if stopping.is_set() else "the step's time budget ran out"
            return {"mixer": name, "status": "failed", "error": f"not run: {reason}"}
        out_dir = fresh_run_dir(ctx.out / "runs" / name)
        options = run_options(name, ctx.gpu_path, size["window"])
        done = ctx.run([ctx.python, "train.py", *base, *options, f"--out_dir={out_dir}"], f"train_{name}")
        result = {"mixer": name, "options": " ".join(options), "seconds": round(done.seconds, 1),
                  **run_summary(out_dir / "metrics.jsonl")}
        problem = ""
        if done.timed_out or done.returncode != 0:
            problem = done.error()
        elif result["last_step"] != size["max_iters"]:
            problem = f"the run stopped at step {result['last_step']} of {size['max_iters']}"
        elif not all(math.isfinite(x) for x in result["losses"]):
            problem = "a loss is not finite"
        elif result["val_loss_end"] is None:
            problem = "no validation loss at the last step"
        elif not result["val_loss_end"] < result["val_loss_start"]:
            problem = f"the validation loss did not decrease ({result['val_loss_start']} -> {result['val_loss_end']})"
        else:
            problem = kernel_use_problem(options, done.output())
        result.pop("losses")
        result["status"], result["error"] = ("failed", problem) if problem else ("passed", "")
        if not ctx.cfg.keep_checkpoints:
            for ckpt in out_dir.glob("ckpt_*"):  # files, or the folders of sharded checkpoints
                shutil.rmtree(ckpt) if ckpt.is_dir() else ckpt.unlink()
        return result

    def ordered():
        return [runs[n] for n in all_runs if n in runs]

    with ThreadPoolExecutor(max_workers=ctx.jobs) as pool:
        futures = [pool.submit(train, name) for name in names]
        for future in as_completed(futures):
            result = future.result()
            runs[result["mixer"]] = result
            print(f"  {result['mixer']}: {result['status']}" + (f" ({result['error'].splitlines()[0][:200]})"
                                                                 if result["error"] else ""), flush=True)
            ctx.publish({"compiled": compile_, "runs": ordered()})
    results = {"compiled": compile_, "jobs": ctx.jobs, "sizes": size, "command": shlex.join(["python", "train.py", *base]),
               "runs": ordered()}
    failed = [r["mixer"] for r in results["runs"] if r["status"] == "failed"]
    summary = f"{len(names) - len(failed)}/{len(names)} runs trained" + \
        (f"; failed: {', '.join(failed)}" if failed else "") + ("" if compile_ else " (not compiled)")
    if failed:
        return outcome("failed", summary, results, "\n\n".join(f"{r['mixer']}: {r['error']}" for r in results["runs"]
                                                              if r["error"]))
    return outcome("passed", summary, results)


def run_summary(path: Path) -> dict:
    """Start and end of a run from its metrics.jsonl: validation loss at the first and last evaluation, the last
    training loss, steady-state tokens/s and MFU (the last logging interval: compilation happens in the first)
    and the largest max_memory_gib (CUDA)."""
    records = read_metrics(path) if path.exists() else []
    train = [r for r in records if "train_loss" in r]
    val = [r for r in records if "val_loss" in r]
    memory = [r["max_memory_gib"] for r in train if "max_memory_gib" in r]
    return {"last_step": train[-1]["step"] if train else 0,
            "train_loss": train[-1]["train_loss"] if train else None,
            "val_loss_start": val[0]["val_loss"] if val else None,
            "val_loss_end": val[-1]["val_loss"] if len(val) > 1 else None,
            "tokens_per_s": train[-1]["tokens_per_s"] if train else None,
            "mfu": train[-1].get("mfu") if train else None,
            "max_memory_gib": max(memory) if memory else None,
            "losses": [r["train_loss"] for r in train] + [r["val_loss"] for r in val]}


def read_losses(out_dir: Path) -> dict:
    """{step: training loss} of a run."""
    return {r["step"]: r["train_loss"] for r in read_metrics(out_dir / "metrics.jsonl") if "train_loss" in r}
