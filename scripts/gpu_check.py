"""Check the GPU path in one command: the GPU tests, training runs of the mixers with GPU kernels and of the
settings a GPU run depends on (compiled, bf16 and fp16, activation checkpointing, FSDP), an exact resume,
measured memory against the planner, pretrained models, every attention backend against the dense reference,
and the benchmarks, with one report to paste into docs/benchmarks.md.

    python -m scripts.gpu_check --plan                                   # budgets from counted compilations
    python -m scripts.gpu_check                                          # the steps that fit 20 minutes on one H100
    python -m scripts.gpu_check --only=backends,bench_attention          # the rest, as --plan prints it
    python -m scripts.gpu_check --steps=preflight,gpu_tests,train_runs   # a subset, into a fresh report
    python -m scripts.gpu_check --only=resume,memory                     # rerun these steps into the same report
    python -m scripts.gpu_check --steps=train_runs --runs=sa,swat        # other training runs than the grid's
    python -m scripts.gpu_check --device=cpu --quick                     # reduced sizes on CPU (checks this script)
    EFFICIENT_ATTENTION_SIMULATE_CUDA=1 python -m scripts.gpu_check --device=cpu --quick   # CUDA's path on the CPU

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

import sys
from pathlib import Path

import torch

if not __package__:  # run as a file, the project's modules cannot be imported: say how to run it
    sys.exit("run it from the repository root as a module: python -m scripts.gpu_check ...")

from config import ConfigError, apply_args, dataclass_fields, exit_on_config_error  # noqa: E402
from scripts.gpucheck.backends import backends_worker  # noqa: E402
from scripts.gpucheck.budgets import default_steps, plan_parts, step_budget, step_estimate  # noqa: E402
from scripts.gpucheck.memory import memory_worker  # noqa: E402
from scripts.gpucheck.options import (CALL_LIMIT_S, COMPILE_S, MARGIN, PROCESS_S, REDUCED, STEPS, TOTAL_LIMIT_S,  # noqa: E402
                                      CheckConfig, train_runs)
from scripts.gpucheck.runner import output_folder_problem, run_check  # noqa: E402


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
    if not c.worker and not c.plan and output_folder_problem(Path(c.out).resolve()):
        raise ConfigError(output_folder_problem(Path(c.out).resolve()))
    return c


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
            print(f"  python -m scripts.gpu_check --only={','.join(part)}")
    parts = plan_parts(names, CALL_LIMIT_S / cfg.budget_scale)
    if len(parts) > 1:
        print(f"the check in commands of at most {CALL_LIMIT_S / 60:.0f} minutes each:")
        first = True
        for part in parts:
            option = "--steps" if first else "--only"
            print(f"  python -m scripts.gpu_check {option}={','.join(part)}")
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
    return run_check(cfg, device, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
