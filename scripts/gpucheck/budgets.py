"""Full-size budgets: each step's compilations counted from the registry and the layers' own plans, at the
cost of one compilation on one H100 (options.COMPILE_S)."""

import functools
import subprocess
import sys
from dataclasses import dataclass

import torch

from attention import simulate_cuda
from attention.capabilities import gpu_kernel
from attention.kernels import plans_in
from attention.registry import MIXERS, example_cases, layer_names
from config import load_config
from model import GPT
from scripts.gpucheck.backends import backend_cases
from scripts.gpucheck.gpu_tests import GPU_TESTS
from scripts.gpucheck.options import (CALL_LIMIT_S, COMPILE_S, FULL, MARGIN, PROCESS_S, REDUCED_BUDGET_S, REPO, STEPS,
                                      TOTAL_LIMIT_S, gpu_kernel_mixers, grid_runs, train_runs)


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
    graph: a forward and backward pair in training, a forward in evaluation, per dtype), its span attention
    kernels (per specialisation: activation, order, ALiBi, dtype) and the GPU kernel
    packages it runs. The kernels each layer plans are read from the model as the CPU standing in for CUDA plans
    it (attention/simulate_cuda.py): no GPU is needed to count them."""
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
        # span attention: Triton's kernels (a forward and three backward ones) per specialisation, not per graph
        flex |= {(None, dtype, "span", (p.activation, p.data.spans.order is not None, p.data.slopes is not None))
                 for p in plans_in(plan) if p.kernel == "span"}
    packages = frozenset(gpu_kernel(MIXERS[mixer])[2] for mixer in set(layer_names(m)) if gpu_kernel(MIXERS[mixer]))
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
                "flex_fwd": len({k for k in kernels if k[2] == "flex_fwd"}),
                "span": len({k for k in kernels if k[2] == "span"})}
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


def shared_cores_scale(load: float, cores: int) -> float:
    """How much longer a reduced (CPU) step takes on cores that other processes already keep busy (load: their
    1-minute load average): the step gets cores / (cores + load) of them, so 1 + load / cores times its time on
    quiet ones (REDUCED_BUDGET_S were measured quiet)."""
    return 1.0 + max(0.0, load) / max(1, cores)


def step_budget(name: str, reduced: bool, gpus: int = 1, runs: str = "", after=()) -> float:
    """A step's time budget in seconds before --budget_scale: reduced, from REDUCED_BUDGET_S; at full size, its
    estimate from counted compilations plus MARGIN (multi_gpu's with two or more GPUs only), given train_runs'
    --runs and the steps run before it by the same command."""
    return REDUCED_BUDGET_S[name] if reduced else step_estimate(name, gpus, runs, frozenset(after)).budget_s


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
