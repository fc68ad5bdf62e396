"""Check the GPU path in one command: the GPU tests, training runs of the mixers with GPU kernels and of the
settings a GPU run depends on (compiled, bf16 and fp16, activation checkpointing, FSDP), an exact resume,
measured memory against the planner, pretrained models, every attention backend against the dense reference,
and the benchmarks, with one report to paste into docs/benchmarks.md.

    python scripts/gpu_check.py --plan                                   # budgets from counted compilations
    python scripts/gpu_check.py                                          # the steps that fit 20 minutes on one H100
    python scripts/gpu_check.py --only=backends,bench_attention          # the rest, as --plan prints it
    python scripts/gpu_check.py --steps=preflight,gpu_tests,train_runs   # a subset, into a fresh report
    python scripts/gpu_check.py --only=resume,memory                     # rerun these steps into the same report
    python scripts/gpu_check.py --steps=train_runs --runs=sa,swat        # other training runs than the grid's
    python scripts/gpu_check.py --device=cpu --quick                     # reduced sizes on CPU (checks this script)
    EFFICIENT_ATTENTION_SIMULATE_CUDA=1 python scripts/gpu_check.py --device=cpu --quick   # CUDA's path on the CPU

Steps, riskiest first (what a first GPU run is most likely to find broken runs while the budget is fresh):

    preflight        versions of torch, CUDA, Triton, fla and mlstm_kernels; fails at once, with the fix, when a
                     GPU kernel package is missing or the installed Triton lacks what they build with
    gpu_tests        python -m pytest -m gpu tests/ (flex backward, the Triton mLSTM, fla's Gated DeltaNet, each
                     against the reference), in parallel workers, each test's outcome recorded as it finishes
    train_runs       train.py: short compiled runs of the mixers with GPU kernels and of the GPU settings, the
                     Triton and fla mixers first, in parallel processes (loss falls, kernels used as asked)
    resume           a compiled bf16 run killed after a checkpoint and resumed: its losses against the unbroken run's
    memory           one block stack of the 1.4B SWAX recipe at 16K tokens: peak memory measured / planned
    pretrained       init_from=hf: and python -m eval --hf= on a small local model, in bf16
    multi_gpu        2-rank NCCL DDP and FSDP runs against one rank (two or more GPUs; said so and skipped on one)
    backends         every backend against dense, forward and backward, every rule family, in bfloat16 (and in
                     float32 at reduced sizes: at full size gpu_tests compares every rule kind in float32)
    bench_attention  scripts/bench_attention.py: full vs sa at paper 000's Table 2 lengths
    bench_train      scripts/bench_train.py: tokens/s and MFU of the 124M recipe, compiled, full depth
    compile_check    scripts/compile_check.py: graph breaks and unexpected recompiles per mixer
    generate         scripts/bench_generate.py: decode throughput and state size, swax vs full

Budgets. Compilation dominates a first GPU run: a FlexAttention forward and backward costs 20-90 s per
distinct mask and shape, Triton autotuning minutes. Each step counts its compilations at full size
(step_estimate: FlexAttention kernel pairs and forwards, block graphs, autotuned packages, cache hits, read
from the registry and the layers' own plans) and its budget is their cost at COMPILE_S plus the work itself,
times MARGIN. Without --steps the check runs, riskiest first, the steps that fit TOTAL_LIMIT_S; --plan prints
the counts, the budgets and the commands for the rest. Full-size grids are trimmed the same way (train_runs
trains the mixers with GPU kernels and the GPU settings; --runs names others).

Each step is isolated: it runs in subprocesses (sys.executable) under a time budget, and a step that fails (an
exception, a nonzero exit, a timeout) is recorded as failed with the tail of its output while the next step
still runs; a timeout kills the step's whole process tree. OUT/report.md and OUT/report.json are rewritten
atomically before and after every step (and after every training run, backend case and GPU test), so a run
cut off by a time limit leaves everything it finished, and a step cut off reports what finished and what did
not; every subprocess's output is kept in OUT/logs/. The exit status is 1 when a step failed, 2 for a bad
option.

On CPU, and with --quick, every step runs at reduced sizes and says so in the report: those numbers check
this script, not the hardware. With EFFICIENT_ATTENTION_SIMULATE_CUDA=1 the CPU takes CUDA's path
(attention/simulate_cuda.py): runs compile, demand the GPU kernels (their CPU stand-ins) and train in bf16.
--only=STEP,... reruns those steps and keeps every other step's result from the report already in OUT (a check
split over several commands, each within a time limit: --plan suggests the split).
"""

import functools
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from attention import simulate_cuda  # noqa: E402
from checkpoint import atomic_write, git_hash, write_json  # noqa: E402
from outputs import markdown_table  # noqa: E402
from config import ConfigError, apply_args, dataclass_fields, exit_on_config_error  # noqa: E402
from run_folder import read_metrics  # noqa: E402


@dataclass
class CheckConfig:
    steps: str = ""  # comma-separated subset of the steps (run in the order above) into a fresh report; empty: all
    only: str = ""  # rerun these steps, keeping the other steps' results from OUT/report.json
    plan: bool = False  # print each step's budget and the total on one H100, run nothing
    out: str = "out/gpu_check"
    device: str = "auto"  # auto (cuda when available) | cuda | cpu
    quick: bool = False  # reduced sizes everywhere (always the case on CPU)
    budget_scale: float = 1.0  # multiplies every step's time budget (a slower GPU, cold compile caches)
    # processes at a time in the steps that compile independent kernels (gpu_tests, train_runs, backends);
    # 0: 4 on CUDA (compilation is CPU-bound and the GPU is shared), 2 on CPU
    jobs: int = 0
    # graph breaks and recompiles are Dynamo's and the same under every backend: aot_eager finds them without
    # generating code (minutes faster); train_runs compiles every mixer family with inductor anyway
    compile_check_backend: str = "aot_eager"
    keep_checkpoints: bool = False  # keep the training runs' checkpoints (deleted by default: OUT stays small)
    runs: str = ""  # train_runs: only these runs (comma-separated names from the report's train_runs table)
    fail_steps: str = ""  # for testing the report: these steps raise at their start, as a broken step would
    worker: str = ""  # internal: run a step's in-process work (backends, memory) in this process, a child of the check
    shard: str = "0/1"  # internal: the part i/n of the backends cases a worker runs


STEPS = ("preflight", "gpu_tests", "train_runs", "resume", "memory", "pretrained", "multi_gpu", "backends",
         "bench_attention", "bench_train", "compile_check", "generate")

# Full-size budgets on one H100 are derived from counted compilations (step_estimate; --plan prints the
# counts). What one compilation costs there, stated once: FlexAttention's forward and backward kernels for one
# mask and shape, 20-90 s of inductor and Triton code generation (CPU-bound: steps that compile independent
# kernels run several processes at once); its forward alone, about a third of that; inductor compiling the rest
# of a block's graph around them, ~15 s; Triton autotuning a GPU kernel package (mlstm_kernels, fla) at its first
# shapes, minutes, once per step (its binaries are cached on disk for the processes after it); a graph found in
# inductor's and Triton's caches (compiled earlier in the check at the same shapes), seconds; Dynamo and
# AOTAutograd without code generation (aot_eager), seconds.
COMPILE_S = {"flex": 60, "flex_fwd": 25, "graph": 15, "autotune": 120, "cached": 3, "aot_eager": 4}
PROCESS_S = 10  # a process's start: imports and CUDA initialisation
MARGIN = 1.25  # a budget is its estimate plus a quarter: a limit to stop at, not a forecast
# reduced sizes (CPU, --quick): budgets in seconds, from runs on 2 CPU cores
REDUCED_BUDGET_S = {"preflight": 20, "gpu_tests": 120, "train_runs": 200, "resume": 90, "memory": 60,
                    "pretrained": 120, "multi_gpu": 0, "backends": 90, "bench_attention": 90, "bench_train": 60,
                    "compile_check": 600, "generate": 60}
MEMORY_RATIO = (0.8, 1.25)  # measured / planned peak the memory step accepts: the plan is for choosing batch sizes
# the memory step's model is sized so that its weights and gradients plus this many times its planned peak fit
# 90% of the GPU's free memory: a peak up to MEMORY_RATIO[1] x the plan (and a tenth more) still fits, so the
# measured / planned ratio decides the step, not an out-of-memory error
MEMORY_HEADROOM = MEMORY_RATIO[1] * 1.1
TOTAL_LIMIT_S = 20 * 60  # the whole check on one H100
CALL_LIMIT_S = 540  # --plan splits the steps into commands of at most this long (a 10-minute session limit)

# Paper 000, Table 2: attention layer latency (forward + backward) of SA (w = 256, compiled FlexAttention) and of
# full attention, on an A100 80GB, B=16, H=16, d_h=64, bf16. n -> (SA ms, full ms, speed-up of SA over full).
PAPER_000_TABLE_2 = {2048: (5.4, 8.0, 1.5), 4096: (7.9, 27.2, 3.5), 8192: (15.2, 99.7, 6.6),
                     16384: (29.6, 379.9, 12.8), 32768: (52.8, 1477.0, 28.0)}

# sizes of every step: full on a GPU, reduced on CPU and with --quick (seconds instead of minutes)
# Full sizes are trimmed to fit TOTAL_LIMIT_S by their counted compilations, riskiest first: what a grid leaves
# out is covered by an earlier step or by the test suite's simulated CUDA path (tests/test_gpu_sim.py), or is a
# benchmark length or variant --variants adds; --plan prints the commands for the runs left out.
FULL = {
    # every (rule, padded length, dtype) compiles its own flex kernels: bfloat16 at a length that is a multiple of
    # the flex block (gpu_tests compares every rule kind's flex kernels with dense in float32 at 300)
    "backends": {"float32": (), "bfloat16": (1024,), "head_dim": 64},
    # paper 000's Table 2 at its longest lengths: sa against full (swa costs what sa costs; --variants adds it)
    "bench_attention": ["--batch=16", "--heads=16", "--head_dim=64", "--dtype=bfloat16", "--window=256",
                        "--variants=full,sa", "--lengths=8192,32768"],
    "bench_train": ["--configs=configs/bridges/owt_124m_full.py", "--n_layer=0", "--batch_size=8"],
    # the runs with a GPU kernel and the GPU settings (train_runs: riskiest first); the other cases' compiled
    # training is what the simulated CUDA path runs in the test suite, --runs=... runs them here
    "train_runs": {"n_embd": 256, "n_head": 4, "block_size": 1024, "window": 128, "batch_size": 8, "max_iters": 30,
                   "eval_iters": 5, "log_interval": 10, "grid": "gpu_kernels"},
    # killed once step 12 is logged: 48 steps (about a second on an H100) before the run would end on its own
    "resume": {"max_iters": 60, "checkpoint_at": 10},
    # the 1.4B SWAX recipe's blocks at 16K tokens, one sequence (fewer layers when the plan says they won't fit)
    "memory": {"config": "configs/swax/swax_1p4b_stochastic.py", "block_size": 16384, "n_layer": 0},
    "generate": ["--contexts=1024,8192", "--n_layer=12", "--n_embd=1024", "--n_head=16", "--dtype=bfloat16"],
}
REDUCED = {
    "backends": {"float32": (300,), "bfloat16": (128,), "head_dim": 16},
    "bench_attention": ["--batch=1", "--heads=4", "--head_dim=64", "--dtype=float32", "--window=64",
                        "--variants=full,swa,sa,sa_swa", "--lengths=512,1024", "--repeats=1"],
    # 2 layers; the 50k- and 32k-token embeddings still dominate a step on CPU, so one short step
    "bench_train": ["--n_layer=2", "--batch_size=1", "--block_size=64", "--steps=1", "--warmup=0"],
    "train_runs": {"n_embd": 64, "n_head": 4, "block_size": 128, "window": 32, "batch_size": 4, "max_iters": 10,
                   "eval_iters": 2, "log_interval": 1},
    # long enough to be killed before it ends (compiled steps on the CPU standing in for CUDA take ~40 ms), and
    # before the next checkpoint on a busy machine (6 steps later)
    "resume": {"max_iters": 40, "checkpoint_at": 8},
    "memory": {"config": "configs/swax/swax_1p4b_stochastic.py", "block_size": 256, "n_layer": 2, "n_embd": 128,
               "n_head": 4, "mlstm_n_head": 2, "vocab_size": 512, "swa_window": 64, "swax_short_window": 32},
    "generate": ["--contexts=128,512", "--n_layer=2", "--n_embd=64", "--n_head=4", "--window=32", "--vocab_size=256",
                 "--new_tokens=8", "--repeats=1"],
}

# train_runs: one run per case of the mixer registry (attention/registry.py: example_cases: every mixer, each of
# its check_variants, each pattern alias) and, on the riskiest of them (the first whose mixers have a GPU kernel:
# swax), one run per setting a GPU run depends on. The cases with GPU kernels run first (the optional Triton and
# fla kernels), then the setting runs (FSDP, activation checkpointing around them), then every other case. On
# CUDA a mixer with a GPU kernel (Mixer.gpu_kernel) is made to use it, so a missing package fails the run
# instead of training with the built-in form. name -> (the settings' extra options, why it is CUDA's alone or "")
SETTING_RUNS = {
    # FSDP2 in one process: bf16 through its mixed-precision policy, sharded checkpoints
    "fsdp": (["--parallelism=fsdp"], ""),
    # the 7B recipe's setting: selective activation checkpointing around compiled blocks (and the Triton mLSTM)
    "ckpt_selective": (["--activation_checkpointing=selective"], ""),
    "ckpt_full": (["--activation_checkpointing=full"], ""),
    "fp16": (["--dtype=float16"], "float16 autocast and its GradScaler are the GPU's"),
    "loss_chunk": (["--loss_chunk=256"], ""),  # the LM head and loss in recomputed chunks
}


def gpu_kernel_mixers() -> dict:
    """The registered mixers that train with a GPU kernel when it is installed: name -> Mixer.gpu_kernel."""
    from attention.registry import MIXERS

    return {name: cls.gpu_kernel for name, cls in MIXERS.items() if cls.gpu_kernel}


def train_runs(window: int) -> dict[str, list[str]]:
    """Every training run of the check, riskiest first: name -> train.py options (the case's settings)."""
    from attention.registry import example_cases, pattern_names

    cases = example_cases(window)
    options = {name: [f"--{key}={value}" for key, value in settings.items()] for name, settings in cases.items()}
    risky = [name for name, settings in cases.items()
             if set(pattern_names(settings["attn_pattern"])) & set(gpu_kernel_mixers())]
    # the riskiest case mixes attention and a GPU kernel (an alias such as swax), else the first risky one
    mixed = [name for name in risky if len(set(pattern_names(cases[name]["attn_pattern"]))) > 1]
    base = (mixed or risky or list(cases))[0]
    runs = {name: options[name] for name in mixed}
    runs.update({f"{base}_{setting}": options[base] + extra for setting, (extra, _) in SETTING_RUNS.items()})
    runs.update({name: options[name] for name in risky + list(cases) if name not in runs})
    return runs


def grid_runs(sizes: dict, chosen: str = "") -> list[str]:
    """The runs train_runs makes, riskiest first: those named by --runs, else the sizes' grid: every run, or
    (grid gpu_kernels) those whose mixers have a GPU kernel and the GPU-setting runs."""
    from attention.registry import pattern_names

    runs = train_runs(sizes["window"])
    if chosen:
        return [name for name in runs if name in chosen.split(",")]
    if sizes.get("grid", "all") == "all":
        return list(runs)
    settings = [name for name in runs if any(name.endswith("_" + setting) for setting in SETTING_RUNS)]
    kernels = [name for name, options in runs.items()
               if set(pattern_names(next(o.partition("=")[2] for o in options if o.startswith("--attn_pattern="))))
               & set(gpu_kernel_mixers())]
    return [name for name in runs if name in settings or name in kernels]


def cuda_only_runs(window: int) -> dict[str, str]:
    """The runs of train_runs that only a GPU can make: name -> why."""
    names = train_runs(window)
    return {name: why for name in names for setting, (_, why) in SETTING_RUNS.items()
            if why and name.endswith("_" + setting)}


# backends: every case of the registry whose layers are attention under edge rules, each against the dense
# reference; w and b of the cases: several windows and block boundaries in the shortest length
BACKEND_WINDOW = 64
BACKEND_CONTEXT = 1024  # the cases' block_size (the bridges' boundaries are those of this context)
BACKEND_HEADS = 8  # four groups of two heads for MSWA
TOLERANCE = {  # against the float32 dense reference
    "float32": "|err| <= 2e-5 + 1e-4 |ref| everywhere",
    # bf16 keeps 8 bits of mantissa; swat's unnormalised sums over the window grow with it, so the error is
    # relative to the whole tensor, as the CUDA tests of tests/test_swat.py measure it
    "bfloat16": "||err|| / ||ref|| <= 2e-2",
}
# resume: the resumed run's training losses against the unbroken run's. On CPU they are equal to the bit; on a
# GPU compiled kernels may reduce in another order between processes (atomics in attention backward)
RESUME_TOLERANCE = {"cpu": 0.0, "cuda": 2e-3}


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")


def tail(text: str, chars: int = 3000) -> str:
    return text if len(text) <= chars else "..." + text[-chars:]


# ---- running commands ---------------------------------------------------------------------------------------

@dataclass
class Completed:
    command: list
    returncode: int | None  # None: killed at its timeout
    seconds: float
    log: str  # path of its output, relative to the repository when inside it
    output_tail: str
    path: Path | None = None  # the log's absolute path

    def output(self) -> str:
        return self.path.read_text(errors="replace") if self.path else self.output_tail

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def error(self) -> str:
        what = (f"timed out after {self.seconds:.0f} s" if self.timed_out
                else f"exited with status {self.returncode}")
        return f"`{shlex.join(self.command)}` {what} (log: {self.log})\n{self.output_tail}"


_children: set = set()  # running subprocesses, killed with their process groups if the check is interrupted
_stopping = threading.Event()  # set by SIGTERM / SIGINT: no new subprocess starts


def descendants(pid: int) -> list[int]:
    """Every process started by pid, and by those, at any depth, whatever session or process group they moved
    to (psutil: by parent pid)."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:  # exited meanwhile
        return []


def kill_tree(proc: subprocess.Popen, reap: bool = True) -> None:
    """Kill proc and every process it started (reap: and wait for proc; a signal handler does not, since the
    Popen it would wait on may be inside wait() in the interrupted code, holding a lock the handler would need). A child that began a session of its own (a nested check's pytest,
    a compile worker) is out of proc's process group, so the tree is walked, not only the group killed. The
    tree is frozen first (SIGSTOP: no process in it starts another, and none is orphaned into another tree
    before it is found), walked again until it stops growing, then killed."""
    tree = set()
    while True:
        new = {proc.pid, *descendants(proc.pid)} - tree
        if not new:
            break
        for pid in new:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        tree |= new
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if reap:
        proc.wait()


def run_command(command: list, log_path: Path, timeout: float, env: dict | None = None, kill_when=None) -> Completed:
    """Run command in the repository with stdout and stderr into log_path, killed (with every process it
    started) when it runs past timeout seconds, or as soon as kill_when() is true (returncode -9)."""
    if _stopping.is_set():
        raise RuntimeError(f"not started, the check is stopping: {shlex.join(command)}")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        _children.add(proc)
        deadline = started + max(1.0, timeout)
        try:
            while True:
                try:
                    returncode = proc.wait(timeout=0.05 if kill_when else max(0.0, deadline - time.time()))
                    break
                except subprocess.TimeoutExpired:
                    if kill_when is not None and kill_when():
                        kill_tree(proc)
                        returncode = -signal.SIGKILL
                        break
                    if time.time() >= deadline:
                        kill_tree(proc)
                        returncode = None
                        break
        finally:
            _children.discard(proc)
    seconds = time.time() - started
    output = log_path.read_text(errors="replace")
    shown = log_path.relative_to(REPO) if log_path.is_relative_to(REPO) else log_path
    return Completed(command, returncode, seconds, str(shown), tail(output), log_path)


def stop_children() -> None:
    """Start no more subprocesses and kill the running ones (safe in a signal handler: no lock is taken; each
    run_command reaps its own)."""
    _stopping.set()
    for proc in list(_children):
        kill_tree(proc, reap=False)


# ---- the check: steps, budgets, the report --------------------------------------------------------------

@dataclass
class StepContext:
    """What a step function gets: the options, where to write, its sizes and its deadline."""

    cfg: CheckConfig
    device: str  # cuda | cpu
    out: Path
    reduced: str  # "" at full size, else the label shown with every number, e.g. "reduced (CPU, --quick)"
    sizes: dict
    budget_s: float
    started: float
    publish: object  # publish(partial results): rewrite the report with the step still running
    explicit: bool  # the step was named in --steps

    @property
    def python(self) -> str:
        return sys.executable

    @property
    def gpu_path(self) -> bool:
        """Whether the runs take CUDA's path: on CUDA, or on the CPU standing in for it (simulate_cuda)."""
        return simulate_cuda.gpu_path(self.device)

    @property
    def jobs(self) -> int:
        """Processes at a time in steps that compile independent kernels."""
        return self.cfg.jobs or (4 if self.device == "cuda" else 2)

    def remaining(self) -> float:
        return self.budget_s - (time.time() - self.started)

    def run(self, command: list, log_name: str, timeout: float | None = None, env: dict | None = None,
            kill_when=None) -> Completed:
        limit = self.remaining() if timeout is None else min(timeout, self.remaining())
        return run_command(command, self.out / "logs" / f"{log_name}.log", limit, env, kill_when)


def outcome(status: str, summary: str, results=None, error: str = "") -> dict:
    return {"status": status, "summary": summary, "results": results, "error": error}


# ---- step: preflight --------------------------------------------------------------------------------------



def torch_triton_pin() -> str:
    """The Triton version the installed torch was built against (its wheel's requirement), or ""."""
    for requirement in importlib.metadata.requires("torch") or []:
        name, _, rest = requirement.partition("==")
        if name.strip() in ("triton", "pytorch-triton") and rest:
            return rest.split(";")[0].strip()
    return ""


def gpu_kernel_problems(device: str, env: dict) -> list[str]:
    """Why the GPU kernels of the recurrent mixers cannot run here, each with its fix (none off CUDA). A missing
    package is a failure on a GPU, not a silent fallback to the built-in forms: the check exists to run them."""
    if device != "cuda":
        return []
    versions, problems = env["optional_kernels"], []
    for package in sorted({kernel[2] for kernel in gpu_kernel_mixers().values()}):  # requirements-gpu.txt
        if versions.get(package, "not installed") == "not installed":
            problems.append(f"{package} is not installed: pip install -r requirements-gpu.txt")
    pin = env.get("triton_pin") or "the version torch pins"
    if versions.get("triton") == "not installed":
        problems.append(f"triton is not installed: pip install triton=={pin} (torch {env['torch']}'s pin)")
    elif not env.get("triton_block_ptr"):
        problems.append(f"Triton {versions.get('triton')} has no tl.make_block_ptr, which mlstm_kernels and fla build "
                        f"their kernels with (Triton 3.9 removed it): pip install triton=={pin}, the version torch "
                        f"{env['torch']} pins, and keep it there (requirements-gpu.txt)")
    elif (env.get("capability") or [0])[0] == 9 and \
            HOPPER_WRONG_TRITON[0] <= version_tuple(versions["triton"]) < HOPPER_WRONG_TRITON[1]:
        problems.append(f"Triton {versions['triton']} on a Hopper GPU ({env['device_name']}): Triton 3.4.0 to 3.7.0 "
                        "compile gated chunked backward kernels wrongly on Hopper (fla issue #640: fla's Gated "
                        "DeltaNet refuses to run its backward there; mlstm_kernels' backward differed from the "
                        "reference in up to 1.4% of the gradients' elements on an H200 with Triton 3.6.0): install "
                        "torch==2.13.0, which brings Triton 3.7.1, as requirements.txt pins")
    return problems


# Triton versions that compile fla's gated chunked backward wrongly on Hopper (fla/ops/common/chunk_o.py refuses
# them, citing fla issue #640): [from, to)
HOPPER_WRONG_TRITON = ((3, 4, 0), (3, 7, 1))


def version_tuple(version: str) -> tuple[int, ...]:
    """(3, 6, 0) for "3.6.0" or "3.6.0+git1234": the release's numbers, for comparisons."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


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


# ---- step: backends (the comparisons run in a child process: --worker=backends) ----------------------

def step_backends(ctx: StepContext) -> dict:
    """Every backend of every rule family (the registry's cases under edge rules) against dense. On an H100 each
    (rule, padded length, dtype) compiles its FlexAttention kernels once, forward and backward (~5 s each): two
    per family (float32 at 300, bfloat16 at 1024), split over ctx.jobs worker processes: about a minute and a
    half."""
    shards = ctx.jobs if ctx.device == "cuda" else 1
    paths = [ctx.out / f"backends_{i}.json" for i in range(shards)]
    for path in paths:
        path.unlink(missing_ok=True)
    command = [ctx.python, os.path.abspath(__file__), "--worker=backends", f"--device={ctx.device}",
               f"--quick={ctx.cfg.quick}", f"--out={ctx.out}"]
    with ThreadPoolExecutor(max_workers=shards) as pool:
        done = list(pool.map(lambda i: ctx.run(command + [f"--shard={i}/{shards}"], f"backends_{i}"), range(shards)))
    parts = [json.loads(path.read_text()) for path in paths if path.exists()]
    results = {"device": ctx.device, "tolerance": TOLERANCE, "window": BACKEND_WINDOW,
               "expected_cases": sum(part["expected_cases"] for part in parts),
               "cases": [case for part in parts for case in part["cases"]], "workers": shards}
    cases = results["cases"]
    failed = [c for c in cases if not c["passed"]]
    expected = results["expected_cases"] if len(parts) == shards else 0
    summary = f"{len(cases) - len(failed)}/{expected or len(cases)} cases within tolerance"
    if failed:
        summary += "; failed: " + ", ".join(sorted({f"{c['family']}/{c['backend']}/{c['dtype']}" for c in failed}))
    broken = [d for d in done if d.timed_out or d.returncode != 0]
    if broken:
        return outcome("failed", summary + f" ({len(cases)} of {expected or '?'} cases ran)", results,
                       "\n\n".join(d.error() for d in broken))
    if failed or not cases or len(cases) < expected:
        return outcome("failed", summary, results, "\n".join(f"{c['family']} {c['backend']} {c['dtype']} n={c['n']}: "
                                                            f"{c.get('error') or 'outside tolerance'}" for c in failed))
    return outcome("passed", summary, results)


def backend_families() -> dict[str, dict]:
    """The cases of the registry (example_cases) whose layers are attention under edge rules (Mixer.edge_rule),
    each with its settings: the backends step compares every backend of each with the dense reference."""
    from attention.registry import example_cases
    from attention.layer import MaskedAttention

    families = {}
    for name, settings in example_cases(BACKEND_WINDOW).items():
        mixers = {type(mixer) for mixer in family_mixers(settings, "dense")}
        if all(issubclass(cls, MaskedAttention) for cls in mixers) and len(mixers) == 1:
            families[name] = settings
    return families


def family_mixers(settings: dict, backend: str, head_dim: int = 16, device="meta") -> list:
    """The layers of a case's model with attn_backend=backend, in evaluation mode, sa with its deterministic
    permutation (the same one under every backend)."""
    from attention.registry import build_mixer
    from config import ModelConfig

    from attention.registry import pattern_names

    layers = len(pattern_names(settings["attn_pattern"]))
    config = ModelConfig(**{"arch": "llama", "n_layer": layers, "n_head": BACKEND_HEADS, "n_embd": BACKEND_HEADS * head_dim,
                            "block_size": BACKEND_CONTEXT, "bias": False, **settings, "attn_backend": backend,
                            "sa_mode": "deterministic"})
    with torch.device(device):
        return [build_mixer(config, i).eval() for i in range(config.n_layer)]


def backend_cases(device: str, sizes: dict) -> list[tuple]:
    """(family, backend, dtype, n) of every comparison: float32 at its first length, then bfloat16, then the
    other float32 lengths (the broadest coverage first, in case the budget runs out)."""
    from attention.edges import Causal

    plan = [("float32", n) for n in sizes["float32"][:1]] + [("bfloat16", n) for n in sizes["bfloat16"]] \
        + [("float32", n) for n in sizes["float32"][1:]]
    families = backend_families()
    cases = []
    for dtype, n in plan:
        for family, settings in families.items():
            causal = type(family_mixers(settings, "dense")[-1].edge_rule()) is Causal
            # plain causal attention: sdpa is its fast path; every other rule runs block-sparse
            for backend in (("sdpa", "flex") if causal else ("flex", "chunked")):
                # CPU flex runs forward only (torch 2.13 has no CPU backward for it), eagerly (~1 s a call): a
                # check of its masks, in float32; its numerics matter on the GPU (the CPU standing in for CUDA
                # runs its reference forward and backward, compiled with aot_eager, in both dtypes)
                if backend == "flex" and not simulate_cuda.gpu_path(device) and dtype != "float32":
                    continue
                cases.append((family, backend, dtype, n))
    return cases


def family_attention(family: str, head_dim: int, device: str):
    """attention(q, k, v, backend) of a case's deepest layer, its own kernel (Mixer.kernel_forward) under each
    backend; backend "dense" is the reference."""
    settings = backend_families()[family]
    layers = {}

    def attention(q, k, v, backend):
        if backend not in layers:
            layers[backend] = family_mixers(settings, backend, head_dim, device)[-1]
        return layers[backend].kernel_forward(q, k, v)
    return attention


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: str) -> tuple[float, float, bool]:
    """(max abs error, relative error ||err|| / ||ref||, within TOLERANCE[dtype])."""
    err = (out.float() - ref).abs()
    max_abs = err.max().item() if err.numel() else 0.0
    rel = (err.norm() / ref.norm().clamp(min=1e-30)).item()
    if dtype == "float32":
        ok = bool((err <= 2e-5 + 1e-4 * ref.abs()).all())
    else:
        ok = rel <= 2e-2
    return max_abs, rel, ok and math.isfinite(max_abs)


def run_backend_case(family, backend, dtype_name, n, head_dim, device) -> dict:
    heads = BACKEND_HEADS
    attention = family_attention(family, head_dim, device)
    generator = torch.Generator().manual_seed(1000 + n)
    q, k, v, grad_out = (torch.randn(2, heads, n, head_dim, generator=generator).to(device) for _ in range(4))
    # the reference: dense in float32 from the same values
    ref_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attention(*ref_inputs, "dense")
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad_out)
    dtype = getattr(torch, dtype_name)
    with_grad = not (backend == "flex" and not simulate_cuda.gpu_path(device))  # CPU flex: forward only
    inputs = [t.to(dtype).requires_grad_(with_grad) for t in (q, k, v)]
    out = attention(*inputs, backend)
    result = {"family": family, "backend": backend, "dtype": dtype_name, "n": n, "heads": heads,
              "head_dim": head_dim}
    result["fwd_max_abs"], result["fwd_rel"], fwd_ok = compare(out, ref, dtype_name)
    bwd_ok = True
    if with_grad:
        grads = torch.autograd.grad(out, inputs, grad_out.to(dtype))
        compared = [compare(g, r, dtype_name) for g, r in zip(grads, ref_grads)]
        result["bwd_max_abs"] = max(c[0] for c in compared)
        result["bwd_rel"] = max(c[1] for c in compared)
        bwd_ok = all(c[2] for c in compared)
    else:
        result["bwd_max_abs"] = result["bwd_rel"] = None
    result["passed"] = fwd_ok and bwd_ok
    return result


def backends_worker(cfg: CheckConfig, device: str) -> None:
    """The backends step's comparisons, in this process (a child of the check), writing OUT/backends_SHARD.json after
    every case so that a crash or a timeout keeps the cases done."""
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")  # CPU flex
    sizes = (FULL if device == "cuda" and not cfg.quick else REDUCED)["backends"]
    shard, shards = (int(x) for x in cfg.shard.split("/"))
    cases = backend_cases(device, sizes)[shard::shards]
    path = Path(cfg.out) / f"backends_{shard}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {"device": device, "tolerance": TOLERANCE, "window": BACKEND_WINDOW, "expected_cases": len(cases),
              "cases": []}
    for family, backend, dtype, n in cases:
        started = time.time()
        try:
            result = run_backend_case(family, backend, dtype, n, sizes["head_dim"], device)
        except Exception as e:  # one backend failing is a result: record it and go on
            result = {"family": family, "backend": backend, "dtype": dtype, "n": n, "passed": False,
                      "error": tail(f"{type(e).__name__}: {e}", 1500), "traceback": tail(traceback.format_exc())}
        result["seconds"] = round(time.time() - started, 2)
        report["cases"].append(result)
        write_json(report, path)
        errors = "  ".join(f"{key} {result[f'{key}_max_abs']:.2e}" for key in ("fwd", "bwd")
                           if result.get(f"{key}_max_abs") is not None)
        print(f"{family:<18}{backend:<9}{dtype:<10}n={n:<6}{errors:<26}{result['seconds']:>6.2f} s  "
              f"{'ok' if result['passed'] else 'FAIL'}" + (f"  {result['error']}" if "error" in result else ""),
              flush=True)


# ---- step: bench_attention ----------------------------------------------------------------------------

def step_bench_attention(ctx: StepContext) -> dict:
    """full vs swa and sa at B=16, H=16, d_h=64, bf16, at 2K, 8K and 32K (paper 000's Table 2 lengths), each case
    a process of its own (start and CUDA init ~5 s). On an H100: full SDPA at 32K is ~0.5 s a step (~1.2e14 FLOPs
    at ~300 TFLOP/s) x 6; sa and swa compile one flex kernel pair per length (6 x ~5 s); about 1.5 minutes."""
    path = ctx.out / "bench_attention.json"
    path.unlink(missing_ok=True)
    done = ctx.run([ctx.python, "scripts/bench_attention.py", f"--device={ctx.device}", *ctx.sizes["bench_attention"],
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
    done = ctx.run([ctx.python, "scripts/bench_train.py", f"--device={ctx.device}", *ctx.sizes["bench_train"],
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
    from data.meta import prepare_generated_if_missing

    prepare_generated_if_missing(str(REPO / "data" / "embedded_byte"))  # once, before runs that may start together
    return ["configs/quickstart.py", "--arch=llama", "--bias=False", "--n_layer=2", f"--n_head={size['n_head']}",
            f"--n_embd={size['n_embd']}", f"--block_size={size['block_size']}", f"--batch_size={size['batch_size']}",
            "--gradient_accumulation_steps=1", f"--max_iters={size['max_iters']}",
            f"--warmup_iters={max(1, size['max_iters'] // 5)}", f"--lr_decay_iters={size['max_iters']}",
            f"--eval_interval={size['max_iters']}", f"--eval_iters={size['eval_iters']}",
            f"--log_interval={size['log_interval']}", f"--compile={compile_}", f"--device={ctx.device}"]


def run_options(name: str, gpu_path: bool, window: int) -> list[str]:
    """A training run's options (train_runs), and on CUDA's path the GPU kernel of each of its mixers that has
    one (Mixer.gpu_kernel): a run that cannot use it fails instead of training with the built-in form."""
    from attention.registry import pattern_names

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
        if ctx.remaining() < 5 or _stopping.is_set():
            reason = "the check was stopped" if _stopping.is_set() else "the step's time budget ran out"
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


# ---- step: memory (the measurement runs in a child process: --worker=memory) --------------------------------

def step_memory(ctx: StepContext) -> dict:
    """One forward and backward of the 1.4B SWAX recipe's blocks at 16K tokens (one sequence, bf16, eager, no
    activation checkpointing), its peak memory against memory_plan.py's estimate for the same shapes:
    building the model and one step, about 30 s. On CPU only the estimate (nothing measures the peak)."""
    path = ctx.out / "memory.json"
    path.unlink(missing_ok=True)
    done = ctx.run([ctx.python, os.path.abspath(__file__), "--worker=memory", f"--device={ctx.device}",
                    f"--quick={ctx.cfg.quick}", f"--out={ctx.out}"], "memory")
    if done.timed_out or done.returncode != 0 or not path.exists():
        return outcome("failed", "the memory measurement failed", None, done.error())
    r = json.loads(path.read_text())
    shape = f"{r['n_layer']} layers x {r['n_embd']}, {r['tokens']:,} tokens"
    if r.get("out_of_memory"):
        low, high = MEMORY_RATIO
        bound = r["more_than_gib"] / r["estimated_gib"]
        return outcome("failed", f"{shape}: out of memory above {r['more_than_gib']:.1f} GiB, planned "
                       f"{r['estimated_gib']:.2f} GiB: measured / planned > {bound:.2f}",
                       r, f"the model was sized so that a peak of {MEMORY_HEADROOM:.2f} x the plan fits: "
                       f"memory_plan.py's estimate is off by more than its stated accuracy ({low}-{high} x the "
                       "measured peak): its per-layer saved-activation counts need fixing")
    if r["measured_gib"] is None:
        return outcome("passed", f"{shape}: planned {r['estimated_gib']:.2f} GiB (not measured on CPU)", r)
    summary = (f"{shape}: measured / planned = {r['measured_gib']:.2f} / {r['estimated_gib']:.2f} GiB = "
               f"{r['ratio']:.2f}")
    low, high = MEMORY_RATIO
    if not low <= r["ratio"] <= high:
        return outcome("failed", summary, r, f"memory_plan.py's estimate is off by more than its stated "
                       f"accuracy ({low}-{high} x the measured peak): its per-layer saved-activation counts need fixing")
    return outcome("passed", summary, r)


def memory_worker(cfg: CheckConfig, device: str) -> None:
    """The memory step's measurement: OUT/memory.json."""
    from config import load_config
    from model import GPT

    import memory_plan

    size = (FULL if device == "cuda" and not cfg.quick else REDUCED)["memory"]
    overrides = [f"--{key}={value}" for key, value in size.items() if key not in ("config", "n_layer") and value]
    run_cfg = load_config([size["config"], *overrides, "--batch_size=1", "--activation_checkpointing=none",
                           "--loss_chunk=0", "--dropout=0.0"])
    m = run_cfg.model
    m.vocab_size = m.vocab_size or memory_plan.DEFAULT_VOCAB
    kernels = memory_plan.Kernels(device, 2 if device == "cuda" else memory_plan.F32)

    def planned(n_layer: int):
        m.n_layer = n_layer
        with torch.device("meta"):
            model = GPT(m)
        e = memory_plan.estimate(model, kernels, 1, "none", 0, memory_plan.Layout(1, "ddp"))
        # no optimizer step and no DDP: the parameters and their gradients are there before it starts (below)
        autocast = e.static.get("autocast bf16 weight copies", 0)
        return e, e.activations_peak + autocast

    n_layer = size["n_layer"] or m.n_layer
    if device == "cuda":  # as many of the recipe's layers as fit this GPU with headroom, whole pattern periods
        from attention.registry import pattern_names

        period = len(pattern_names(m.attn_pattern))  # swax: 2 layers

        def needed(layers: int) -> float:  # the float32 weights and gradients, and the planned peak with headroom
            step = planned(layers)[1]
            return 2 * memory_plan.F32 * _param_count(m) + MEMORY_HEADROOM * step
        n_layer = memory_layers(n_layer, period, 0.9 * torch.cuda.mem_get_info()[0], needed)
    estimate, estimated = planned(n_layer)
    result = {"config": size["config"], "n_layer": n_layer, "recipe_n_layer": load_config([size["config"]]).model.n_layer,
              "n_embd": m.n_embd, "attn_pattern": m.attn_pattern, "tokens": m.block_size, "batch_size": 1,
              "dtype": "bfloat16" if device == "cuda" else "float32", "estimated_gib": estimated / 2**30,
              "estimate_breakdown_gib": {"activations at the peak": estimate.activations_peak / 2**30,
                                         "autocast weight copies": (estimated - estimate.activations_peak) / 2**30},
              "peak_moment": estimate.peak_moment, "measured_gib": None, "ratio": None}
    if device == "cuda":
        torch.manual_seed(0)
        with torch.device(device):  # built on the GPU: initialising 1.4B parameters on the CPU takes minutes
            model = GPT(m)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        x = torch.randint(0, m.vocab_size, (1, m.block_size), device=device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base, free = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(x, x)
            loss.backward()
            torch.cuda.synchronize()
        except torch.cuda.OutOfMemoryError:  # the peak passed MEMORY_HEADROOM x the plan: a ratio beyond bounds
            # the step needed more than was free when it started (and at least the peak it reached)
            result.update(out_of_memory=True, measured_gib=None, ratio=None, weights_and_gradients_gib=base / 2**30,
                          more_than_gib=max(free, torch.cuda.max_memory_allocated() - base) / 2**30)
            write_json(result, Path(cfg.out) / "memory.json")
            return
        measured = torch.cuda.max_memory_allocated() - base
        result.update(measured_gib=measured / 2**30, ratio=measured / estimated,
                      weights_and_gradients_gib=base / 2**30)
    write_json(result, Path(cfg.out) / "memory.json")


def memory_layers(n_layer: int, period: int, free: float, needed) -> int:
    """The most layers, from n_layer down by whole pattern periods (at least one period), whose needed(layers)
    bytes fit in free."""
    while n_layer > period and needed(n_layer) > free:
        n_layer -= period
    return n_layer


def _param_count(m) -> int:
    from model import GPT

    with torch.device("meta"):
        return GPT(m).num_params()


# ---- step: pretrained ---------------------------------------------------------------------------------------

def train_byte_bpe_tokenizer(text: str, path: Path) -> int:
    """A byte-level BPE tokenizer.json with GPT-2's end-of-text token, trained on text; returns its vocabulary
    size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(path))
    return tokenizer.get_vocab_size()


def build_tiny_hf_model(root: Path, documents: int = 60) -> tuple[Path, Path]:
    """A small random Qwen3 (grouped-query attention, qk-norm) saved with save_pretrained beside a byte-level BPE
    tokenizer trained on the embedded corpus, and that corpus prepared with it: (model folder, data folder)."""
    import transformers

    from data.embedded import documents as embedded_documents
    from data.prepare import prepare

    transformers.utils.logging.disable_progress_bar()
    root.mkdir(parents=True, exist_ok=True)
    text = "\n\n".join(embedded_documents(documents, seed=0))
    (root / "corpus.txt").write_text(text)
    folder = root / "tiny-qwen3"
    folder.mkdir(exist_ok=True)
    vocab = train_byte_bpe_tokenizer(text, folder / "tokenizer.json")
    config = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=vocab,
                                      max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
    data_dir = root / "corpus_tok"
    prepare(str(root / "corpus.txt"), tokenizer=str(folder), out_dir=str(data_dir), val_fraction=0.2, num_proc=1,
            quiet=True)
    return folder, data_dir


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
    script = REPO / "scripts" / "compile_check.py"
    if not script.exists():
        return outcome("missing", "scripts/compile_check.py does not exist yet: nothing checked")
    if ctx.device == "cpu" and ctx.cfg.quick and not ctx.explicit:
        return outcome("skipped", "skipped in --quick mode on CPU (compiling every mixer on 2 cores takes minutes): "
                                  "name it in --steps to run it")
    path = ctx.out / "compile_check.json"
    path.unlink(missing_ok=True)
    done = ctx.run([ctx.python, str(script.relative_to(REPO)), f"--device={ctx.device}",
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
    done = ctx.run([ctx.python, "scripts/bench_generate.py", f"--device={ctx.device}", "--variants=swax,full",
                    *ctx.sizes["generate"], f"--json={path}"], "generate")
    if done.timed_out or done.returncode != 0 or not path.exists():
        return outcome("failed", "scripts/bench_generate.py failed", None, done.error())
    data = json.loads(path.read_text())
    by_case = {(r["variant"], r["context"]): r for r in data["results"]}
    ratios = [f"{context}: {r['decode_tokens_per_s'] / by_case[('full', context)]['decode_tokens_per_s']:.2f}x"
              for (variant, context), r in by_case.items() if variant == "swax" and ("full", context) in by_case]
    return outcome("passed", "swax decode speed over full at context " + ", ".join(ratios),
                   {**data, "command": shlex.join(done.command)})


# ---- full-size budgets: counted compilations ------------------------------------------------------------------

@dataclass(frozen=True)
class Estimate:
    """A step's work at full size on one H100: its compilations by kind (COMPILE_S), the processes it starts and
    how many run at once, and the time of the work itself beside compiling."""

    compiles: tuple  # ((kind, count), ...)
    processes: int
    jobs: int
    run_s: float
    left_out: str = ""  # what the full-size grid leaves out to fit TOTAL_LIMIT_S, and the command that runs it

    @property
    def seconds(self) -> float:
        compile_s = sum(COMPILE_S[kind] * count for kind, count in self.compiles)
        return (self.processes * PROCESS_S + compile_s) / max(1, min(self.jobs, self.processes)) + self.run_s

    @property
    def budget_s(self) -> float:
        return MARGIN * self.seconds

    def describe(self) -> str:
        kinds = ", ".join(f"{count} {kind}" for kind, count in self.compiles if count) or "none"
        return f"{kinds}; {self.processes} process{'es' if self.processes != 1 else ''}" + \
            (f", {min(self.jobs, self.processes)} at a time" if min(self.jobs, self.processes) > 1 else "")


def _estimate(compiles: dict, processes: int, jobs: int, run_s: float, left_out: str = "") -> Estimate:
    return Estimate(tuple((kind, compiles.get(kind, 0)) for kind in COMPILE_S if compiles.get(kind)), processes,
                    jobs, run_s, left_out)


@functools.cache
def run_compiles(name: str) -> tuple[frozenset, frozenset, frozenset]:
    """What a full-size compiled training run (train_runs' run `name`) compiles on CUDA, as keys, so that a step
    counts each distinct compilation once (a repeat is found in inductor's and Triton's caches): its block graphs
    (one per distinct Mixer.compile_key, in training and in evaluation; the dtype, FSDP and activation
    checkpointing change them, loss_chunk does not), its FlexAttention kernels (per flex call in a distinct
    graph: a forward and backward pair in training, a forward in evaluation, per dtype) and the GPU kernel
    packages it runs. The kernels each layer plans are read from the model as the CPU standing in for CUDA plans
    it (attention/simulate_cuda.py): no GPU is needed to count them."""
    from attention.kernels import plans_in
    from attention.registry import MIXERS, layer_names
    from config import load_config
    from model import GPT

    size = FULL["train_runs"]
    options = dict(o[2:].split("=", 1) for o in train_runs(size["window"])[name])
    cfg = load_config(["configs/quickstart.py", "--arch=llama", "--bias=False", "--n_layer=2",
                       f"--n_head={size['n_head']}", f"--n_embd={size['n_embd']}",
                       f"--block_size={size['block_size']}", *(f"--{k}={v}" for k, v in options.items())])
    m = cfg.model
    m.vocab_size = m.vocab_size or 256
    with torch.device("meta"):
        model = GPT(m)
    with simulate_cuda.simulating():
        plans = model.plan(size["batch_size"], m.block_size, "cpu")
    dtype = options.get("dtype", "bfloat16")
    layout = (dtype, cfg.train.parallelism)
    graphs, flex = set(), set()
    for block, plan in zip(model.blocks, plans):
        key = block.mixer.compile_key()
        graphs |= {(key, "train", *layout, cfg.train.activation_checkpointing), (key, "eval", *layout)}
        calls = sum(p.kernel == "flex" for p in plans_in(plan))
        flex |= {(key, dtype, kind, i) for i in range(calls) for kind in ("flex", "flex_fwd")}
    packages = frozenset(MIXERS[mixer].gpu_kernel[2] for mixer in set(layer_names(m)) if MIXERS[mixer].gpu_kernel)
    return frozenset(graphs), frozenset(flex), packages


@functools.cache
def collected_gpu_tests() -> tuple[str, ...] | None:
    """The ids of the tests gpu_tests runs (pytest --collect-only; the Triton and fla kernels' tests only where
    their packages are installed), or None when they cannot be collected (gpu_tests then fails and says why)."""
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               *GPU_TESTS], cwd=REPO, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    tests = tuple(line for line in proc.stdout.splitlines() if "::" in line)
    return tests if proc.returncode == 0 and tests else None


# the FlexAttention kernel pairs gpu_tests is budgeted for when its tests cannot be collected (36 tests, 16
# pairs, when this was written)
GPU_TESTS_FLEX_UNCOLLECTED = 24


def runs_compiles(names: list[str], autotuned: bool) -> dict:
    """The compilations of training runs one after the other in one step: each distinct graph and kernel once,
    their repeats as cache hits; each GPU kernel package autotuned once (a cache hit when an earlier step of the
    same command, gpu_tests, autotuned it)."""
    runs = [run_compiles(run) for run in names]
    graphs, kernels = [g for r in runs for g in r[0]], [k for r in runs for k in r[1]]
    distinct = {"graph": len(set(graphs)), "flex": len({k for k in kernels if k[2] == "flex"}),
                "flex_fwd": len({k for k in kernels if k[2] == "flex_fwd"})}
    packages = len(set().union(*(r[2] for r in runs))) if runs else 0
    cached = len(graphs) + len(kernels) - sum(distinct.values()) + (packages if autotuned else 0)
    return {**distinct, "cached": cached, "autotune": 0 if autotuned else packages}


def train_runs_commands(left: list[str]) -> list[str]:
    """The runs left out of train_runs' full-size grid, as commands of at most CALL_LIMIT_S each by budget."""
    commands, part = [], []
    for run in left:
        if part and step_estimate("train_runs", runs=",".join(part + [run])).budget_s > CALL_LIMIT_S:
            commands.append(part)
            part = []
        part.append(run)
    return [f"--steps=train_runs --runs={','.join(p)}" for p in commands + ([part] if part else [])]


@functools.cache
def step_estimate(name: str, gpus: int = 1, runs: str = "", after: frozenset = frozenset()) -> Estimate:
    """What step `name` compiles and runs at full size on one H100. gpus: how many the machine has; runs: train_runs'
    --runs; after: the steps run before it by the same command (whose compilations it then finds in the caches
    on disk: gpu_tests autotunes the GPU kernels' packages, train_runs compiles the riskiest run resume repeats)."""
    from attention.registry import example_cases

    packages = len({kernel[2] for kernel in gpu_kernel_mixers().values()})
    window = FULL["train_runs"]["window"]
    if name == "preflight":
        return _estimate({}, 1, 1, 5)
    if name == "gpu_tests":  # a test with flex in its id compiles a kernel pair; each GPU kernel package autotunes
        tests = collected_gpu_tests()
        flex = GPU_TESTS_FLEX_UNCOLLECTED if tests is None else sum("flex" in test for test in tests)
        return _estimate({"flex": flex, "autotune": packages}, 5, 4, 30)
    if name == "train_runs":  # distinct graphs and kernels compile, repeats come from the caches
        names = grid_runs(FULL["train_runs"], runs)
        left = [run for run in train_runs(window) if run not in names] if not runs else []
        left_out = f"{len(left)} runs: " + "; ".join(train_runs_commands(left)) if left else ""
        return _estimate(runs_compiles(names, "gpu_tests" in after), len(names), 4, 2 * len(names), left_out)
    if name == "resume":  # three runs of the riskiest case: after train_runs, its graphs and kernels are cached
        riskiest = next(iter(train_runs(window)))
        compiles = runs_compiles([riskiest] * (1 if "train_runs" in after else 3), "gpu_tests" in after)
        if "train_runs" in after:
            compiles = {"cached": 3 * sum(compiles.values())}
        return _estimate(compiles, 3, 1, 15)
    if name == "memory":  # eager: the swa layers' flex pair as one compiled call, the mLSTM kernel at new shapes
        return _estimate({"flex": 1, "graph": 1}, 1, 1, 30)
    if name == "pretrained":  # a compiled fine-tuning run (train and evaluation graphs), then python -m eval
        return _estimate({"graph": 2, "flex": 1, "flex_fwd": 2}, 2, 1, 25)
    if name == "multi_gpu":
        if gpus < 2:
            return _estimate({}, 0, 1, 0)
        graphs, kernels, _ = run_compiles("swa")
        first = {"graph": len(graphs), "flex": len(kernels) // 2, "flex_fwd": len(kernels) // 2}
        return _estimate({**first, "cached": 3 * (len(graphs) + len(kernels))}, 6, 1, 40)
    if name == "backends":
        cases = backend_cases("cuda", FULL["backends"])
        flex = len({(family, dtype, n) for family, backend, dtype, n in cases if backend == "flex"})
        return _estimate({"flex": flex}, 4, 4, 0.3 * len(cases))
    if name == "bench_attention":
        args = dict(a[2:].split("=", 1) for a in FULL["bench_attention"])
        variants, lengths = args["variants"].split(","), args["lengths"].split(",")
        cases = len(variants) * len(lengths)  # one process each; full attention is SDPA (nothing to compile)
        return _estimate({"flex": sum(v != "full" for v in variants) * len(lengths)}, cases, 1, 3 * cases)
    if name == "bench_train":  # every block shares one graph: compiled for training
        return _estimate({"graph": 2}, 1, 1, 20)
    if name == "compile_check":
        return _estimate({"aot_eager": len(example_cases(32))}, 1, 1, len(example_cases(32)))
    if name == "generate":  # swax's prefill: one forward flex kernel per context length; decoding runs eagerly
        args = dict(a[2:].split("=", 1) for a in FULL["generate"])
        return _estimate({"flex_fwd": len(args["contexts"].split(","))}, 1, 1, 15)
    raise ValueError(f"unknown step {name!r}")


STEP_FUNCTIONS = {"preflight": step_preflight, "gpu_tests": step_gpu_tests, "train_runs": step_train_runs,
                  "resume": step_resume, "memory": step_memory, "pretrained": step_pretrained,
                  "multi_gpu": step_multi_gpu, "backends": step_backends, "bench_attention": step_bench_attention,
                  "bench_train": step_bench_train, "compile_check": step_compile_check, "generate": step_generate}


# ---- the report ---------------------------------------------------------------------------------------

def environment(device: str) -> dict:
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        name, memory = torch.cuda.get_device_name(0), f"{props.total_memory / 2**30:.1f} GiB"
    else:
        model = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                      if line.startswith("model name")), platform.processor() or "CPU")
        name, memory = f"CPU: {model} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)", ""
    optional = {}  # Triton, each registered GPU kernel's package (Mixer.gpu_kernel), and fla's kernels
    for package in ("triton", *sorted({kernel[2] for kernel in gpu_kernel_mixers().values()}), "fla-core"):
        try:
            optional[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            optional[package] = "not installed"
    block_ptr = None
    if optional["triton"] != "not installed":
        try:
            import triton.language

            block_ptr = hasattr(triton.language, "make_block_ptr")
        except Exception:  # a broken Triton install: reported as lacking it
            block_ptr = False
    return {"device": device, "device_name": name, "device_memory": memory, "torch": str(torch.__version__),
            "cuda": torch.version.cuda or "", "python": platform.python_version(), "optional_kernels": optional,
            "triton_pin": torch_triton_pin(), "triton_block_ptr": block_ptr,
            "gpus": torch.cuda.device_count() if device == "cuda" else 0, "git_hash": git_hash(),
            "capability": list(torch.cuda.get_device_capability(0)) if device == "cuda" else []}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def write_report(report: dict, out: Path) -> None:
    write_json(report, out / "report.json")
    text = render_markdown(report)
    atomic_write(out / "report.md", lambda f: f.write(text.encode()))


def render_markdown(report: dict) -> str:
    lines = ["# GPU check", ""]
    for i, run in enumerate(report["runs"]):
        label = f"run {i + 1}: " if len(report["runs"]) > 1 else ""
        kernels = ", ".join(f"{k} {v}" for k, v in run["optional_kernels"].items())
        lines += [f"- {label}device: **{run['device_name']}**" + (f", {run['device_memory']}" if run["device_memory"]
                                                                  else ""),
                  f"- torch {run['torch']}" + (f" (CUDA {run['cuda']})" if run["cuda"] else "")
                  + f", Python {run['python']}; {kernels}",
                  f"- git {run['git_hash']}; {run['started']}",
                  f"- command: `{run['command']}`",
                  f"- sizes: {run['reduced'] or 'full'}" + (" (numbers check the script, not the hardware)"
                                                             if run["reduced"] else ""), ""]
    lines += _table(["step", "status", "seconds", "budget (s)", "sizes", "summary"],
                    [[name, f"**{step['status']}**", f"{step['seconds']:.0f}", f"{step['budget_s']:.0f}",
                      step["reduced"] or "full", _cell(step["summary"])]
                     for name, step in ((name, report["steps"].get(name)) for name in STEPS) if step is not None])
    lines.append("")
    for number, name in enumerate(STEPS, 1):
        step = report["steps"].get(name)
        if step is None:
            continue
        lines += [f"## {number}. {name}: {step['status']}", ""]
        if step["reduced"]:
            lines += [f"**{step['reduced']}**: reduced sizes, not comparable with GPU measurements.", ""]
        lines += [step["summary"], ""]
        if step.get("results") and name in RENDERERS:
            try:
                lines += RENDERERS[name](step["results"]) + [""]
            except Exception as e:  # a partial or unexpected result still leaves the rest of the report
                lines += [f"(results not rendered: {type(e).__name__}: {e}; see report.json)", ""]
        if step.get("error"):
            lines += ["Error:", "", "```", step["error"].strip(), "```", ""]
    return "\n".join(lines)


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _num(value, fmt="{:,.1f}") -> str:
    return "" if value is None else fmt.format(value)


def render_gpu_tests(results: dict) -> list[str]:
    by_file = {}
    for t in results["tests"]:
        counts = by_file.setdefault(t["test"].split("::")[0], {})
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
        counts["seconds"] = counts.get("seconds", 0) + t["seconds"]
    lines = _table(["test module", "passed", "failed", "errors", "skipped", "seconds"],
                   [[module, c.get("passed", 0), c.get("failed", 0), c.get("error", 0), c.get("skipped", 0),
                     f"{c['seconds']:.1f}"] for module, c in sorted(by_file.items())])
    bad = [t for t in results["tests"] if t["outcome"] in ("failed", "error")]
    if bad:
        lines += [""] + _table(["failed test", "message"], [[t["test"], _cell(t["message"][:200])] for t in bad])
    if results.get("unfinished"):
        lines += ["", f"Did not finish ({len(results['unfinished'])} of {results['collected']} collected): "
                      + ", ".join(f"`{t}`" for t in results["unfinished"])]
    return lines


def render_backends(results: dict) -> list[str]:
    rows = {}
    for c in results["cases"]:
        rows.setdefault((c["family"], c["backend"], c["dtype"]), []).append(c)
    tolerance = results.get("tolerance", TOLERANCE)
    heads = sorted({c["heads"] for c in results["cases"] if c.get("heads")})
    lines = [f"Every backend against `dense` in float32 (B=2, H={'/'.join(map(str, heads))}; "
             f"w = b = {results.get('window')}); "
             f"errors are the largest over the lengths. Tolerance: float32 {tolerance['float32']}; bfloat16 "
             f"{tolerance['bfloat16']} (max abs error shown).", ""]
    table = []
    for (family, backend, dtype), cases in rows.items():
        worst = lambda key: max((c[key] for c in cases if c.get(key) is not None), default=None)  # noqa: E731
        bwd = "fwd only" if all(c.get("bwd_max_abs") is None and "error" not in c for c in cases) \
            else _num(worst("bwd_max_abs"), "{:.2e}")
        ok = "yes" if all(c["passed"] for c in cases) else "**NO**: " + "; ".join(
            _cell(c.get("error", "outside tolerance"))[:160] for c in cases if not c["passed"])
        table.append([family, backend, dtype, ", ".join(str(c["n"]) for c in cases),
                      _num(worst("fwd_max_abs"), "{:.2e}"), bwd,
                      f"{_num(worst('fwd_rel'), '{:.1e}')} / {_num(worst('bwd_rel'), '{:.1e}')}", ok])
    return lines + _table(["rule", "backend", "dtype", "lengths", "fwd max abs err", "bwd max abs err",
                           "fwd / bwd rel err", "ok"], table)


def render_bench_attention(results: dict) -> list[str]:
    variants = list(dict.fromkeys(key for row in results["rows"] for key in row if key not in ("n", "paper_000")))
    paper = any("paper_000" in row for row in results["rows"])
    lines = [f"`{results['command']}` on {results['device']}: forward + backward of the attention op, best of the "
             "timed runs; speed-up over full in brackets."
             + (" Paper 000's Table 2 (A100 80GB, same shapes): SA with compiled FlexAttention against full "
                "attention." if paper else ""), ""]
    table = []
    for row in results["rows"]:
        cells = []
        for v in variants:
            r = row.get(v)
            cells.append("" if r is None else f"{r['ms']:,.1f} ms" + (f" ({r['speedup']:.1f}x)" if v != "full" and
                                                                      r["speedup"] else ""))
        if paper:
            p = row.get("paper_000")
            cells.append(f"{p['sa_ms']} / {p['full_ms']:,} ms ({p['speedup']}x)" if p else "")
        table.append([f"{row['n']:,}", *cells])
    return lines + _table(["n", *variants, *(["paper 000: SA / full (A100)"] if paper else [])], table)


def _table(columns: list[str], rows: list[list]) -> list[str]:
    """A markdown table, as report lines (outputs.markdown_table)."""
    return markdown_table(columns, rows).split("\n")


def render_bench_train(results: dict) -> list[str]:
    rows = [[f"`{r['config']}`", r["arch"], r["n_layer"], r["n_embd"], f"{r['params_M']}M",
             f"{r['block_size']} x {r['batch_size']}", r.get("compile", ""), f"{r['step_ms']:,} ms",
             f"{r['tokens_per_s']:,.0f}", _num(r.get("mfu"), "{:.1%}"), _num(r.get("max_memory_gib"), "{:.1f} GiB")]
            for r in results["results"]]
    return [f"`{results['command']}` on {results['device']}, {results['dtype']}: median step after warmup.", ""] + \
        _table(["config", "arch", "layers", "d", "params", "context x batch", "compiled", "step", "tokens/s", "MFU",
                "peak memory"], rows)


def render_train_runs(results: dict) -> list[str]:
    lines = []
    if "command" in results:
        lines += [f"`{results['command']} --attn_pattern=... --out_dir=...`"
                  + ("" if results.get("compiled") else " (not compiled)") + "; validation loss at the first and the "
                  "last step, tokens/s over the last logging interval.", ""]
    rows = [[r["mixer"], r.get("options", ""), r["status"],
             f"{r['val_loss_start']:.3f} -> {r['val_loss_end']:.3f}" if r.get("val_loss_end") is not None else "",
             _num(r.get("train_loss"), "{:.3f}"), _num(r.get("tokens_per_s"), "{:,.0f}"), _num(r.get("mfu"), "{:.1%}"),
             _num(r.get("max_memory_gib"), "{:.2f} GiB"), _num(r.get("seconds"), "{:.0f}")] for r in results["runs"]]
    return lines + _table(["mixer", "options", "status", "val loss", "final train loss", "tokens/s", "MFU",
                           "peak memory", "seconds"], rows)


def render_compile_check(results: dict) -> list[str]:
    rows = []
    for c in results.get("results", []):
        if "graphs" not in c:
            rows.append([c["mixer"], "", "", "", "", f"{c.get('status')}: {_cell(c.get('error', ''))[:200]}"])
            continue
        note = f" ({c['expected_breaks']})" if c.get("expected_breaks") else ""
        rows.append([c["mixer"], f"{c['graphs']} ({c['expected_graphs']})", f"{c['graph_breaks']}{note}",
                     c["unexpected_recompiles"], c.get("seconds", ""), c["status"]])
    return [f"`{results['command']}`", ""] + _table(["mixer", "graphs (expected)", "graph breaks",
                                                     "unexpected recompiles", "seconds", "status"], rows)


def render_generate(results: dict) -> list[str]:
    rows = [[f"{r['context']:,}", r["variant"], f"{r['prefill_ms']:,.1f} ms",
             f"{r['decode_tokens_per_s']:,.0f} tokens/s", f"{r['state_mib']:.2f} MiB",
             _num(r.get("decode_peak_mib"), "{:.1f} MiB")] for r in results["results"]]
    return [f"`{results['command']}` on {results['device']}", ""] + \
        _table(["context", "model", "prefill", "decode", "generation state", "decode peak memory"], rows)


def render_resume(results: dict) -> list[str]:
    rows = [[step, f"{a:.6f}", f"{b:.6f}", f"{abs(a - b):.2e}"] for step, a, b in
            zip(results["compared_steps"], results["losses"]["unbroken"], results["losses"]["resumed"])]
    return [f"`{results['command']}`: killed (SIGKILL) after step {results['killed_after_step']}, resumed from the "
            f"checkpoint at step {results['checkpoint_at']}.", ""] + _table(["step", "unbroken", "resumed", "|diff|"], rows)


def render_memory(results: dict) -> list[str]:
    rows = [[f"`{results['config']}`", f"{results['n_layer']} of {results['recipe_n_layer']}", results["attn_pattern"],
             f"{results['tokens']:,}", results["dtype"],
             f"out of memory above {results['more_than_gib']:.1f} GiB" if results.get("out_of_memory")
             else _num(results["measured_gib"], "{:.2f} GiB"),
             f"{results['estimated_gib']:.2f} GiB", _num(results["ratio"], "{:.2f}")]]
    return ["Peak memory of one forward and backward (eager, no checkpointing, batch 1) above the float32 weights "
            "and gradients, against `memory_plan.py`'s activations at their peak "
            f"({results['peak_moment']}) plus autocast's weight copies.", ""] + \
        _table(["config", "layers", "pattern", "tokens", "dtype", "measured", "planned", "measured / planned"], rows)


RENDERERS = {"gpu_tests": render_gpu_tests, "backends": render_backends, "bench_attention": render_bench_attention,
             "bench_train": render_bench_train, "train_runs": render_train_runs, "resume": render_resume,
             "memory": render_memory, "compile_check": render_compile_check, "generate": render_generate}


# ---- main -----------------------------------------------------------------------------------------------

def parse(argv) -> CheckConfig:
    c = CheckConfig()
    fields = dataclass_fields(CheckConfig)
    # a boolean option given bare (--quick) means True
    argv = [f"{arg}=True" if arg.startswith("--") and fields.get(arg[2:], ("", None))[1] is bool else arg
            for arg in argv]
    apply_args(c, argv, fields)
    for option in ("steps", "only", "fail_steps"):
        unknown = [s for s in getattr(c, option).split(",") if s and s not in STEPS]
        if unknown:
            raise ConfigError(f"{option}: unknown step(s) {', '.join(unknown)}; expected some of {', '.join(STEPS)}")
    if c.steps and c.only:
        raise ConfigError("give --steps (a fresh report) or --only (rerun into the report in OUT), not both")
    known_runs = train_runs(REDUCED["train_runs"]["window"])
    unknown = [name for name in c.runs.split(",") if name and name not in known_runs]
    if unknown:
        raise ConfigError(f"runs: unknown run(s) {', '.join(unknown)}; expected some of {', '.join(known_runs)}")
    if c.device not in ("auto", "cuda", "cpu"):
        raise ConfigError(f"device={c.device!r}: expected auto, cuda or cpu")
    if c.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but CUDA is not available here (torch "
                          f"{torch.__version__}): run on a GPU machine, or use --device=cpu --quick")
    if c.budget_scale <= 0 or c.jobs < 0:
        raise ConfigError("need budget_scale > 0 and jobs >= 0")
    if c.worker not in ("", "backends", "memory"):
        raise ConfigError(f"worker={c.worker!r}: the workers are backends and memory")
    shard = c.shard.split("/")
    if len(shard) != 2 or not all(x.isdigit() for x in shard) or not int(shard[0]) < int(shard[1]):
        raise ConfigError(f"shard={c.shard!r}: expected I/N with 0 <= I < N")
    return c


def step_budget(name: str, reduced: bool, gpus: int = 1, runs: str = "", after=()) -> float:
    """A step's time budget in seconds before --budget_scale: reduced, from REDUCED_BUDGET_S; at full size, its
    estimate from counted compilations plus MARGIN (multi_gpu's with two or more GPUs only), given train_runs'
    --runs and the steps run before it by the same command."""
    return REDUCED_BUDGET_S[name] if reduced else step_estimate(name, gpus, runs, frozenset(after)).budget_s


def step_descriptions() -> dict[str, str]:
    """Each step's line from this module's docstring (its "Steps" list), joined with its continuation lines."""
    described, name = {}, None
    for line in __doc__.splitlines():
        first = line[4:].split(" ", 1)[0] if line.startswith("    ") and not line.startswith("     ") else ""
        if first in STEPS:
            name = first
            described[name] = line[4 + len(name):].strip()
        elif name and line.startswith(" " * 21) and line.strip():
            described[name] += " " + line.strip()
        else:
            name = None
    return described


def plan_parts(names: list[str], limit: float = CALL_LIMIT_S) -> list[list[str]]:
    """The steps in order, grouped into commands of at most `limit` seconds of budget each (each step's budget
    counted within its own command: what an earlier command compiled is not assumed cached)."""
    parts, total = [[]], 0.0
    for name in names:
        budget = step_budget(name, False, after=parts[-1])
        if parts[-1] and total + budget > limit:
            parts.append([])
            total, budget = 0.0, step_budget(name, False)
        parts[-1].append(name)
        total += budget
    return parts


def default_steps(gpus: int = 1, budget_scale: float = 1.0) -> list[str]:
    """The steps a full-size check runs when none are named: in STEPS order (riskiest first), each that still fits
    TOTAL_LIMIT_S by its budget (times budget_scale); the others are left to a second command (--plan prints it)."""
    chosen, total = [], 0.0
    for name in STEPS:
        budget = step_budget(name, False, gpus, after=chosen) * budget_scale
        if total + budget <= TOTAL_LIMIT_S:
            chosen.append(name)
            total += budget
    return chosen


def print_plan(cfg: CheckConfig) -> None:
    """Each step's budget on one H100 from its counted compilations, the total, the steps left to a second command,
    and commands that split the check within CALL_LIMIT_S each."""
    named = cfg.steps or cfg.only
    names = [s for s in STEPS if s in named.split(",")] if named else default_steps(budget_scale=cfg.budget_scale)
    what = step_descriptions()
    print("Budgets on one H100, from each step's compilations at "
          + ", ".join(f"{COMPILE_S[kind]} s per {kind}" for kind in COMPILE_S) + f", {PROCESS_S} s per process "
          f"start, and the work itself; a budget is the estimate x {MARGIN}")
    print("step             budget   compilations (processes)                  what it checks")
    budgets = {}
    for i, name in enumerate(names):
        budget = budgets[name] = step_budget(name, False, runs=cfg.runs, after=names[:i]) * cfg.budget_scale
        estimate = step_estimate(name, runs=cfg.runs, after=frozenset(names[:i]))
        note = ""
        if name == "multi_gpu":
            note = f" ({step_budget(name, False, 2):.0f} s with two or more GPUs: {step_estimate(name, 2).describe()})"
        print(f"{name:<17}{budget:>4.0f} s   {estimate.describe():<40}  {what[name]}{note}")
        if estimate.left_out:
            print(f"{'':<26}left out to fit {TOTAL_LIMIT_S // 60} minutes: {estimate.left_out}")
    total = sum(budgets.values())
    print(f"total            {total:>8.0f} s = {total / 60:.1f} minutes on one H100 (limit "
          f"{TOTAL_LIMIT_S // 60} minutes; budgets are limits, each step usually ends sooner)")
    rest = [name for name in STEPS if name not in names]
    if not named and rest:
        later = sum(step_budget(name, False, after=rest[:i]) for i, name in enumerate(rest)) * cfg.budget_scale
        print(f"left to a second command ({later / 60:.1f} minutes: the benchmarks, and checks that the steps "
              f"above or the test suite's simulated CUDA path cover in part):")
        for part in plan_parts(rest, CALL_LIMIT_S / cfg.budget_scale):
            print(f"  python scripts/gpu_check.py --only={','.join(part)}")
    parts = plan_parts(names, CALL_LIMIT_S / cfg.budget_scale)
    if len(parts) > 1:
        print(f"the check in commands of at most {CALL_LIMIT_S / 60:.0f} minutes each:")
        first = True
        for part in parts:
            option = "--steps" if first else "--only"
            print(f"  python scripts/gpu_check.py {option}={','.join(part)}")
            first = False


def main(argv) -> int:
    cfg = exit_on_config_error(parse, argv)
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.plan:
        print_plan(cfg)
        return 0
    if cfg.worker:
        (backends_worker if cfg.worker == "backends" else memory_worker)(cfg, device)
        return 0
    reduced = [label for label, on in (("CPU", device == "cpu"), ("--quick", cfg.quick),
                                       ("simulated CUDA", simulate_cuda.simulated(device))) if on]
    reduced = f"reduced ({', '.join(reduced)})" if reduced else ""
    sizes = REDUCED if reduced else FULL
    chosen = cfg.steps or cfg.only
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    # at full size the steps that fit TOTAL_LIMIT_S (--plan names the rest); reduced, every step
    names = [s for s in STEPS if s in chosen.split(",")] if chosen else \
        (list(STEPS) if reduced else default_steps(gpus, cfg.budget_scale))
    failing = set(filter(None, cfg.fail_steps.split(",")))
    out = Path(cfg.out).resolve()  # subprocesses run in the repository
    out.mkdir(parents=True, exist_ok=True)

    run = {**environment(device), "command": shlex.join(["python", "scripts/gpu_check.py", *argv]),
           "started": now(), "reduced": reduced, "options": asdict(cfg)}
    report = {"runs": [], "steps": {}}
    if cfg.only and (out / "report.json").exists():
        report = json.loads((out / "report.json").read_text())
        for name in names:
            report["steps"].pop(name, None)
        if not report["steps"]:
            report["runs"] = []
    report["runs"].append(run)
    report.update({k: run[k] for k in ("device", "device_name", "torch", "git_hash", "command")})
    run_index = len(report["runs"]) - 1
    print(f"gpu check: {run['device_name']}; torch {run['torch']}; git {run['git_hash']}; "
          f"{reduced or 'full sizes'}; steps: {', '.join(names)}; report: {out / 'report.md'}", flush=True)

    stop_signal = []

    def interrupt(signum, frame):  # the running step's subprocesses die, so it ends as failed, and the loop stops
        stop_signal.append(signum)
        signal.signal(signum, signal.SIG_DFL)  # a second signal stops at once
        stop_children()

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)

    for name in names:
        budget = step_budget(name, bool(reduced), run["gpus"], cfg.runs, names[:names.index(name)]) * cfg.budget_scale
        record = {"status": "running", "seconds": 0.0, "budget_s": budget, "reduced": reduced, "run": run_index,
                  "summary": "running (a report showing this was cut off during the step)", "results": None,
                  "error": "", "started": now()}
        report["steps"][name] = record
        write_report(report, out)
        print(f"[{name}] budget {budget:.0f} s ...", flush=True)
        started = time.time()

        def publish(partial, record=record, started=started):
            record["results"], record["seconds"] = partial, time.time() - started
            write_report(report, out)

        ctx = StepContext(cfg, device, out, reduced, sizes, budget, started, publish,
                          explicit=name in chosen.split(","))
        try:
            if name in failing:
                raise RuntimeError(f"injected failure (--fail_steps={cfg.fail_steps})")
            record.update(STEP_FUNCTIONS[name](ctx))
        except Exception as e:  # a broken step is a result: record it, and go on with the next one
            record.update(status="failed", summary=f"{type(e).__name__}: {str(e)[:200]}",
                          error=tail(traceback.format_exc()))
        if stop_signal:
            record.update(status="failed", summary=f"interrupted by signal {stop_signal[0]}: " + record["summary"])
        record["seconds"] = time.time() - started
        record["finished"] = now()
        write_report(report, out)
        print(f"[{name}] {record['status']} in {record['seconds']:.0f} s: {record['summary']}", flush=True)
        if stop_signal:
            break
    failed = [name for name in names if report["steps"].get(name, {}).get("status") == "failed"]
    print(f"report: {out / 'report.md'} and {out / 'report.json'}; "
          + (f"failed: {', '.join(failed)}" if failed else "no step failed"), flush=True)
    if stop_signal:
        return 128 + stop_signal[0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
