"""The GPU check's steps, each a function of a StepContext returning an outcome (backends and memory have
modules of their own)."""

import json
import math
import re
import shlex
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch

from attention.registry import pattern_names
from data.prepare import prepare_generated_if_missing
from common.run_folder import read_metrics
from scripts.gpucheck.context import StepContext, outcome
from scripts.gpucheck.environment import environment, gpu_kernel_problems
from scripts.gpucheck.options import (PAPER_000_TABLE_2, REPO, RESUME_TOLERANCE, cuda_only_runs, gpu_kernel_mixers, grid_runs,
                                      train_runs)
from scripts.gpucheck.processes import stopping
from scripts.gpucheck.tiny_hf import build_tiny_hf_model


# ---- step: preflight --------------------------------------------------------------------------------------


def step_preflight(ctx: StepContext) -> dict:
    """Versions, and whether the GPU kernels can run: a second."""
    env = environment(ctx.device)
    kernels = ", ".join(f"{k} {v}" for k, v in env["optional_kernels"].items())
    summary = f"torch {env['torch']}" + (f", CUDA {env['cuda']}" if env["cuda"] else "") + f"; {kernels}"
    results = {key: env[key] for key in ("torch", "cuda", "optional_kernels", "triton_pin", "triton_block_ptr",
                                         "gpus")}
    problems = gpu_kernel_problems(ctx.device, env)
    if problems:
        return outcome("failed", summary, results, "\n".join(problems))
    on_cpu = " (the GPU kernels' CPU stand-ins: simulated CUDA)" if ctx.gpu_path else \
        " (the GPU kernels are not needed on CPU)"
    return outcome("passed", summary + ("" if ctx.device == "cuda" else on_cpu), results)


# ---- step: gpu_tests ----------------------------------------------------------------------------------------

GPU_TESTS = ["-m", "gpu", "tests/"]  # the tests marked gpu (tests/conftest.py), by marker: never by name
# on CUDA these must be among the tests that passed: they are defined only where their kernel is installed
REQUIRED_GPU_TESTS = {
    "mlstm_kernels' Triton kernel": "test_cuda_triton_kernel_equals_native_chunkwise_and_mlstm_kernels_backward",
    "fla's Gated DeltaNet kernel": "test_cuda_fla_layer_equals_native_layer_in_bf16"}


def missing_kernel_tests(device: str, tests: list[dict], collected: list[str] | None = None) -> list[str]:
    """The GPU kernels whose tests did not pass in a gpu_tests run on CUDA (none off CUDA), each with why: not
    collected (the package is not installed), collected but unfinished (the step was cut off), or failed."""
    if device != "cuda":
        return []
    outcomes = {t["test"].rpartition("::")[2].partition("[")[0]: t["outcome"] for t in tests}
    names = {test.rpartition("::")[2].partition("[")[0] for test in (collected or [])}
    missing = []
    for kernel, name in REQUIRED_GPU_TESTS.items():
        if outcomes.get(name) == "passed":
            continue
        if name in outcomes:
            why = f"{name} {outcomes[name]}"
        elif name in names:
            why = f"{name} did not finish before the step was cut off"
        else:
            why = f"{name} did not pass (not installed, or it failed)"
        missing.append(f"{kernel}: {why}")
    return missing


def read_results_log(path: Path) -> tuple[list[str], list[dict]]:
    """tests/conftest.py's --results-log: (the collected test ids, each finished test's last record); a line torn
    by a kill is skipped."""
    collected, tests = [], {}
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "collected" in record:
            collected = record["collected"]
        elif record.get("outcome") != "passed" or record["test"] not in tests:  # a teardown error stays an error
            tests[record["test"]] = record
    return collected, list(tests.values())


def step_gpu_tests(ctx: StepContext) -> dict:
    """The tests marked gpu in ctx.jobs pytest workers, each test's outcome recorded as it finishes (so a step cut
    off by its budget reports what finished and what did not). On an H100 each test of a flex backend compiles
    its rule's FlexAttention kernels, and the Triton and fla kernel tests autotune their packages (step_estimate
    counts them). On CPU they run under the device guard of tests/conftest.py (flex forward only)."""
    log = ctx.out / "gpu_tests.jsonl"
    log.unlink(missing_ok=True)
    workers = ["-n", str(ctx.jobs)] if ctx.device == "cuda" and ctx.jobs > 1 else []
    done = ctx.run([ctx.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers, *GPU_TESTS,
                    f"--results-log={log}"], "gpu_tests")
    collected, tests = read_results_log(log)
    counts = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    unfinished = [test for test in collected if test not in {t["test"] for t in tests}]
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no tests ran"
    if unfinished:
        summary += f"; {len(unfinished)} of {len(collected)} did not finish"
    if done.timed_out:
        summary = f"timed out after {done.seconds:.0f} s: " + summary
    if ctx.device != "cuda":
        summary += " (on the CPU, under the device guard" + \
            ("; simulated CUDA: flex forward and backward)" if ctx.gpu_path else ")")
    results = {"counts": counts, "tests": tests, "collected": len(collected), "unfinished": unfinished,
               "command": shlex.join(done.command)}
    missing = missing_kernel_tests(ctx.device, tests, collected)
    if done.timed_out or done.returncode != 0 or not tests or missing or unfinished:
        # pytest exits 5 when it collects nothing: the GPU tests are missing, a failure too
        failure = [done.error()] if done.timed_out or done.returncode else []
        not_run = [f"did not finish: {', '.join(unfinished[:20])}" + (" ..." if len(unfinished) > 20 else "")] \
            if unfinished else []
        return outcome("failed", summary, results, "\n".join(missing + not_run + failure))
    return outcome("passed", summary, results)


# ---- step: bench_attention ----------------------------------------------------------------------------

def step_bench_attention(ctx: StepContext) -> dict:
    """full vs swa and sa at B=16, H=16, d_h=64, bf16, at 2K, 8K and 32K (paper 000's Table 2 lengths), each case
    a process of its own (start and CUDA init ~5 s). On an H100: full SDPA at 32K is ~0.5 s a step (~1.2e14 FLOPs
    at ~300 TFLOP/s) x 6; sa and swa compile one flex kernel pair per length (6 x ~5 s); about 1.5 minutes."""
    path = ctx.out / "bench_attention.json"
    path.unlink(missing_ok=True)
    done = ctx.run([ctx.python, "-m", "scripts.bench_attention", f"--device={ctx.device}", *ctx.sizes["bench_attention"],
                    f"--json={path}"], "bench_attention")
    if done.timed_out or done.returncode != 0 or not path.exists():
        return outcome("failed", "scripts/bench_attention.py failed", None, done.error())
    data = json.loads(path.read_text())
    rows = {}
    for r in data["results"]:
        rows.setdefault(r["n"], {})[r["variant"]] = r
    table = []
    for n, by_variant in sorted(rows.items()):
        row = {"n": n}
        for name, r in by_variant.items():
            row[name] = {"ms": round(r["ms"], 2), "peak_mib": round(r["peak_mib"], 1), "backend": r["backend"],
                         "speedup": round(r["speedup_vs_full"], 2) if r.get("speedup_vs_full") else None}
        if n in PAPER_000_TABLE_2 and not ctx.reduced:
            sa_ms, full_ms, speedup = PAPER_000_TABLE_2[n]
            row["paper_000"] = {"sa_ms": sa_ms, "full_ms": full_ms, "speedup": speedup}
        table.append(row)
    sa_speedups = [f"{row['n']}: {row['sa']['speedup']}x" for row in table if row.get("sa", {}).get("speedup")]
    return outcome("passed", "sa over full: " + ", ".join(sa_speedups), {"device": data["device"], "rows": table,
                                                                          "command": shlex.join(done.command)})


# ---- step: bench_train --------------------------------------------------------------------------------

def step_bench_train(ctx: StepContext) -> dict:
    """The 124M recipe (12 x 768, 1024 tokens) at full depth, batch 8, compiled per block (every block shares
    one graph: one compilation of ~40 s). A step is 6 x 124M x 8K = 6e12 FLOPs (~15 ms at 40% MFU): compilation
    dominates, about a minute. (scripts/bench_train.py alone also measures the 360M recipe.)"""
    path = ctx.out / "bench_train.json"
    path.unlink(missing_ok=True)
    done = ctx.run([ctx.python, "-m", "scripts.bench_train", f"--device={ctx.device}", *ctx.sizes["bench_train"],
                    f"--compile={ctx.device == 'cuda'}", f"--json={path}"], "bench_train")  # CPU: minutes to compile
    if done.timed_out or done.returncode != 0 or not path.exists():
        return outcome("failed", "scripts/bench_train.py failed", None, done.error())
    data = json.loads(path.read_text())
    summary = ", ".join(f"{Path(r['config']).stem}: {r['tokens_per_s']:,.0f} tokens/s"
                        + (f", MFU {100 * r['mfu']:.1f}%" if r.get("mfu") else "") for r in data["results"])
    return outcome("passed", summary, {**data, "command": shlex.join(done.command)})


# ---- step: train_runs ---------------------------------------------------------------------------------

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


# ---- step: resume -----------------------------------------------------------------------------------------

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


def read_losses(out_dir: Path) -> dict:
    """{step: training loss} of a run."""
    return {r["step"]: r["train_loss"] for r in read_metrics(out_dir / "metrics.jsonl") if "train_loss" in r}


# ---- step: pretrained -------------------------------------------------------------------------------------

def step_pretrained(ctx: StepContext) -> dict:
    """A small local Qwen3 (grouped-query attention) in bf16: fine-tuned from init_from=hf: with a sliding window
    in its attention (compiled on CUDA), and evaluated with python -m eval --hf=: about 40 s."""
    root = fresh_run_dir(ctx.out / "pretrained")
    folder, data_dir = build_tiny_hf_model(root)
    dtype = "bfloat16" if ctx.gpu_path else "float32"
    train = ["train.py", f"--init_from=hf:{folder}", f"--data_dir={data_dir}", f"--out_dir={root / 'run'}",
             "--attn_pattern=swa", "--swa_window=32", "--block_size=128", "--batch_size=4",
             "--gradient_accumulation_steps=1", "--max_iters=10", "--warmup_iters=2", "--lr_decay_iters=10",
             "--learning_rate=1e-3", "--eval_interval=10", "--eval_iters=2", "--log_interval=5",
             f"--compile={ctx.gpu_path}", f"--device={ctx.device}", f"--dtype={dtype}"]
    done = ctx.run([ctx.python, *train], "pretrained_train")
    if done.timed_out or done.returncode != 0:
        return outcome("failed", "init_from=hf: failed", None, done.error())
    metrics = run_summary(root / "run" / "metrics.jsonl")
    evaluate = [ctx.python, "-m", "eval", f"--hf={folder}", f"--data_dir={data_dir}", f"--out_dir={root / 'eval'}",
                "--attn_pattern=swa", "--swa_window=32", "--tasks=ppl", "--ppl_lengths=128", "--limit=4",
                f"--device={ctx.device}", f"--dtype={dtype}", "--progress=False"]
    done = ctx.run(evaluate, "pretrained_eval")
    report = root / "eval" / "eval" / "ppl.json"
    if done.timed_out or done.returncode != 0 or not report.exists():
        return outcome("failed", "python -m eval --hf= failed", None, done.error())
    ppl = json.loads(report.read_text())
    results = {"train": {"val_loss_start": metrics["val_loss_start"], "val_loss_end": metrics["val_loss_end"],
                         "command": shlex.join(["python", *train])},
               "eval": {"command": shlex.join(["python", *evaluate[1:]]), "results": ppl.get("results")}, "dtype": dtype}
    losses = [metrics["val_loss_start"], metrics["val_loss_end"]]
    if None in losses or not all(math.isfinite(x) for x in losses) or not losses[1] < losses[0]:
        return outcome("failed", f"fine-tuning from the Hugging Face model: val loss {losses}", results)
    return outcome("passed", f"init_from=hf: val loss {losses[0]:.3f} -> {losses[1]:.3f} ({dtype}); eval --hf= "
                             "wrote ppl.json", results)


# ---- step: multi_gpu ----------------------------------------------------------------------------------------

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


# ---- step: compile_check ------------------------------------------------------------------------------

def step_compile_check(ctx: StepContext) -> dict:
    """scripts/compile_check.py: every registry case (22 today) as a 2-layer model, 3 training steps and an
    evaluation each; with aot_eager (Dynamo's capture and AOTAutograd's backward, no code generation: inductor's
    runs are train_runs) 2-4 s a case, about a minute and a half (inductor: ~15 s a case, 5-6 minutes)."""
    if ctx.device == "cpu" and ctx.cfg.quick and not ctx.explicit:
        return outcome("skipped", "skipped in --quick mode on CPU (compiling every mixer on 2 cores takes minutes): "
                                  "name it in --steps to run it")
    path = ctx.out / "compile_check.json"
    path.unlink(missing_ok=True)
    done = ctx.run([ctx.python, "-m", "scripts.compile_check", f"--device={ctx.device}",
                    f"--backend={ctx.cfg.compile_check_backend}", f"--json={path}"], "compile_check")
    data = json.loads(path.read_text()) if path.exists() else None
    cases = data["results"] if data else []
    clean = [c for c in cases if c.get("status") == "ok"]
    summary = f"{len(clean)}/{len(cases)} mixers compile clean ({ctx.cfg.compile_check_backend})"
    failed = [c["mixer"] for c in cases if c.get("status") != "ok"]
    if failed:
        summary += "; not clean: " + ", ".join(failed)
    results = {**(data or {}), "command": shlex.join(done.command)}
    if done.timed_out or done.returncode != 0 or not cases:
        return outcome("failed", summary, results, done.error())
    return outcome("passed", summary, results)


# ---- step: generate -----------------------------------------------------------------------------------

def step_generate(ctx: StepContext) -> dict:
    """Decoding swax vs full after 1K and 8K prompts, a 12 x 1024 model in bf16: 4 cases x 3 repeats of a prefill
    and 64 decode steps (~1-3 ms each), plus building the models: under a minute."""
    path = ctx.out / "bench_generate.json"
    path.unlink(missing_ok=True)
    done = ctx.run([ctx.python, "-m", "scripts.bench_generate", f"--device={ctx.device}", "--variants=swax,full",
                    *ctx.sizes["generate"], f"--json={path}"], "generate")
    if done.timed_out or done.returncode != 0 or not path.exists():
        return outcome("failed", "scripts/bench_generate.py failed", None, done.error())
    data = json.loads(path.read_text())
    by_case = {(r["variant"], r["context"]): r for r in data["results"]}
    ratios = [f"{context}: {r['decode_tokens_per_s'] / by_case[('full', context)]['decode_tokens_per_s']:.2f}x"
              for (variant, context), r in by_case.items() if variant == "swax" and ("full", context) in by_case]
    return outcome("passed", "swax decode speed over full at context " + ", ".join(ratios),
                   {**data, "command": shlex.join(done.command)})
