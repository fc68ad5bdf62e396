"""What the GPU check runs and at what sizes: its options and steps, the budgets' constants, the run grids."""

from dataclasses import dataclass
from pathlib import Path

from attention.capabilities import gpu_kernel
from attention.registry import MIXERS, example_cases, pattern_names


REPO = Path(__file__).resolve().parents[2]


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
COMPILE_S = {"flex": 60, "flex_fwd": 25, "graph": 15, "autotune": 120, "cached": 3, "aot_eager": 4, "span": 20}
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
# out is covered by an earlier step or by the test suite's simulated CUDA path (tests/models/test_gpu_sim.py), or is a
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
                        "--variants=full,sa", "--lengths=256,512", "--repeats=1"],
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
# CUDA a mixer with a GPU kernel (the mixer's gpu_kernel) is made to use it, so a missing package fails the run
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
    """The registered mixers that train with a GPU kernel when it is installed: name -> the mixer's gpu_kernel."""
    return {name: gpu_kernel(cls) for name, cls in MIXERS.items() if gpu_kernel(cls)}


def train_runs(window: int) -> dict[str, list[str]]:
    """Every training run of the check, riskiest first: name -> train.py options (the case's settings)."""
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
    # relative to the whole tensor, as the CUDA tests of tests/layers/test_swat.py measure it
    "bfloat16": "||err|| / ||ref|| <= 2e-2",
}
# resume: the resumed run's training losses against the unbroken run's. On CPU they are equal to the bit; on a
# GPU compiled kernels may reduce in another order between processes (atomics in attention backward)
RESUME_TOLERANCE = {"cpu": 0.0, "cuda": 2e-3}
