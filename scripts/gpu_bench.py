"""The GPU benchmark in one call: what each variant's attention costs per allowed edge, what the model trains at,
and train.py's step against nanoGPT's.

    python -m scripts.gpu_bench --nanogpt=../nanoGPT/model.py          # the three tables (about 6 minutes, H200)
    python -m scripts.gpu_bench --parts=kernels --lengths=8192 --kernel_variants=full,swa,swat
    python -m scripts.gpu_bench --parts=train --train_variants=full,swa,swax --train_len=16384

Parts:
  kernels   forward + backward of each variant's attention op (bench_attention's cases: the layer's own plan and
            kernel, CASE:KEY=VALUE for settings such as swa:attn_backend=flex) at each length, --batch x --heads x
            --head_dim in bf16 with --window: best time of the repeats, against full attention (SDPA's flash
            kernel), scores computed per allowed edge, and time per allowed edge relative to swa's
  train     a GPT-2 124M (configs/bridges/owt_124m_full.py) at --train_len tokens, batch 1, each variant's windows and
            blocks --train_window long (MoBA: blocks of half of it, top 2), compiled bf16 with train.py's layout
            (runtime/parallelize.py): median tokens/s of the timed steps against full attention, and MFU; the
            --train_profile cases then profile 3 steps (the kernels that took their time)
  nanogpt   GPT-2 124M, batch 16 x 1024, bf16 autocast, fused AdamW, steps alternating between train.py's layout, the
            same model compiled whole and nanoGPT's model.py compiled whole (--nanogpt: its file, from a clone of
            github.com/karpathy/nanoGPT; without it this part is left out and says so)

Every case runs in a process of its own (one torch thread), in rounds of --jobs cases: a round's cases compile and
warm up at once (inductor's and Triton's caches are shared on disk); once all are warm, each times alone, one after
the other (a file lock), from its warm state, so no case is timed beside another's work (a case not warm by
--ready_by is stopped and reported), and only a round's cases hold GPU memory at once.
Each case's log (OUT/logs) says where its warm-up spent its time. Results: the tables printed and written to OUT/report.md, every number in
OUT/gpu_bench.json with the GPU's name and the torch and Triton versions.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

if not __package__:  # run as a file, the project's modules cannot be imported: say how to run it
    sys.exit("run it from the repository root as a module: python -m scripts.gpu_bench ...")

from attention.capabilities import EdgeCounts  # noqa: E402
from attention.kernels import layer_scores  # noqa: E402
from attention.layer import Attention  # noqa: E402
from attention.ops.span.op import TILES_ENV  # noqa: E402
from attention.registry import MIXERS, PATTERN_ALIASES, build_mixer, example_cases, pattern_names  # noqa: E402
from config import ConfigError, apply_args, dataclass_fields, exit_on_config_error, load_config  # noqa: E402
from model import GPT  # noqa: E402
from common.flops import peak_flops  # noqa: E402
from common.outputs import claim_own_folder, markdown_table, own_folder_problem, write_json  # noqa: E402
from runtime.parallelize import parallelize  # noqa: E402
from scripts.bench_attention import BenchConfig as AttentionConfig  # noqa: E402
from scripts.bench_attention import backend_of, variant_config  # noqa: E402

PARTS = ("kernels", "train", "nanogpt")
# the kernels FlexAttention also runs, beside the default cases: the baselines span attention is measured against
FLEX_BASELINES = ("swa:attn_backend=flex", "swat:attn_backend=flex")
OUTPUT_MARKER = ".gpu_bench"  # marks OUT as the benchmark's own: each run empties its logs and results there


@dataclass
class BenchConfig:
    parts: str = "kernels,train,nanogpt"
    out: str = "out/gpu_bench"
    # kernels
    # cases of the registry (example_cases), CASE:KEY=VALUE for settings, VARIANT@MxNxWxS for span attention's tiles
    # of M query rows x N keys, W warps, S stages; "": every attention case of the registry and FLEX_BASELINES
    kernel_variants: str = ""
    lengths: str = "8192,32768"
    batch: int = 4
    heads: int = 16
    head_dim: int = 64
    window: int = 256
    repeats: int = 10
    # train
    train_variants: str = ""  # mixers or pattern aliases; "": every attention mixer of the registry and every alias
    train_len: int = 8192
    train_window: int = 512
    train_steps: int = 10
    # training cases whose timed steps are followed by 3 profiled ones: the GPU kernels that took their time
    train_profile: str = "full,swa"
    train_compile: bool = True  # False: eager (a quick check of the script on the CPU)
    # nanogpt
    nanogpt: str = ""  # nanoGPT's model.py
    nanogpt_steps: int = 20
    nanogpt_batch: int = 16
    train_layers: int = 0  # 0: the config's 12 (fewer: a quick check of the script)
    timeout: int = 480  # seconds for the whole benchmark; cases unfinished by then are reported as such
    ready_by: int = 150  # seconds for a round's cases to compile and warm up; later ones are stopped and reported
    jobs: int = max(1, min(8, (os.cpu_count() or 2) // 2))  # cases per round: warming up (compiling) at once
    device: str = "cuda"  # cpu: runs the script's code on small sizes (a check of the script, not a measurement)
    job: str = ""  # internal: run one case (PART:NAME) in this process


def parse(argv) -> BenchConfig:
    b = BenchConfig()
    apply_args(b, argv, dataclass_fields(BenchConfig))
    unknown = [p for p in b.parts.split(",") if p not in PARTS]
    if unknown:
        raise ConfigError(f"parts: unknown {', '.join(unknown)}; expected some of {', '.join(PARTS)}")
    if not b.job and own_folder_problem(Path(b.out), OUTPUT_MARKER, "the GPU benchmark", "out/gpu_bench"):
        raise ConfigError(own_folder_problem(Path(b.out), OUTPUT_MARKER, "the GPU benchmark", "out/gpu_bench"))
    if b.nanogpt and not Path(b.nanogpt).is_file():
        raise ConfigError(f"nanogpt={b.nanogpt}: no such file; give the path of nanoGPT's model.py (a clone of "
                          "github.com/karpathy/nanoGPT)")
    if min(b.repeats, b.train_steps, b.nanogpt_steps, b.batch) < 1:
        raise ConfigError("repeats, train_steps, nanogpt_steps and batch must be >= 1")
    return b


# ---- the cases (each in its own process) -----------------------------------------------------------------------

def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def release_memory():
    """Give the caching allocator's free blocks back while waiting for the turn to time: every case's warm-up peak
    held at once would not fit one GPU. The first step inside the turn, untimed, takes them again."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def max_memory_gib():
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


class TurnToTime:
    """Warm up freely, then time alone: say this case is ready, wait until the driver says every case is (no case
    compiles or warms up on the GPU while another is timed), then take an exclusive lock shared by every case."""

    def __init__(self, out: Path):
        self.path, self.out = out / ".timing.lock", out

    def __enter__(self):
        (self.out / "ready" / safe(os.environ.get("GPU_BENCH_JOB", "case"))).touch()
        progress("ready; waiting for every case")
        while not (self.out / "ready" / GO).exists():
            time.sleep(0.2)
        progress("timing")
        self.file = open(self.path, "a")
        fcntl.flock(self.file.fileno(), fcntl.LOCK_EX)
        synchronize()
        return self

    def __exit__(self, *exc):
        synchronize()
        fcntl.flock(self.file.fileno(), fcntl.LOCK_UN)
        self.file.close()


def kernel_case(name: str, b: BenchConfig, out: Path) -> list[dict]:
    device = torch.device(b.device)
    a = AttentionConfig(batch=b.batch, heads=b.heads, head_dim=b.head_dim, window=b.window, dtype="bfloat16")
    steps = []
    for n in (int(x) for x in b.lengths.split(",")):
        m = variant_config(name, a, n)
        with torch.device(device):
            mixer = build_mixer(m, m.n_layer - 1).to(device)  # the deepest layer (MSWA's widest windows)
        step = kernel_step(mixer, mixer.kernel_inputs(b.batch, n, device, torch.bfloat16))
        for _ in range(2):  # compilation, autotuning, caches
            step()
        progress(f"{name} warm at n={n}")
        edges = sum(e for _, e in mixer.edge_counts(n)) / m.n_head if isinstance(mixer, EdgeCounts) else None
        scores = layer_scores(mixer, n, device)[1]
        steps.append((n, m, mixer, step, edges, scores))
    results = []
    release_memory()
    with TurnToTime(out):
        for n, m, mixer, step, edges, scores in steps:
            step()  # untimed: the allocator's blocks again
            times = []
            for _ in range(b.repeats):
                t0 = time.perf_counter()
                step()
                synchronize()
                times.append(1000 * (time.perf_counter() - t0))
            results.append({"variant": name, "n": n, "backend": backend_of(mixer, n, device), "ms": min(times),
                            "runs_ms": [round(t, 3) for t in times], "edges_per_head": edges,
                            "scores_per_head": scores, "scores_per_edge": scores / edges if scores and edges else None})
    return results


def kernel_step(mixer, inputs):
    """One forward + backward of the mixer's kernel on these inputs (each length's own: no shared closure)."""
    grad = None

    def step():
        nonlocal grad
        y = mixer.kernel_forward(*inputs)
        grad = torch.randn_like(y) if grad is None else grad
        y.backward(grad)
        for t in inputs:
            t.grad = None
    return step


_started = time.time()


def progress(message: str) -> None:
    """A line in the case's log with the seconds since it started: where a slow warm-up spends its time."""
    print(f"[{time.time() - _started:6.1f} s] {message}", flush=True)


def train_settings(variant: str, b: BenchConfig) -> list[str]:
    w = b.train_window
    return [f"--attn_pattern={variant}", f"--block_size={b.train_len}", f"--swa_window={w}", f"--block_len={w}",
            f"--bridge_width={w}", f"--bridge_extension={w // 2}", f"--moba_block={w // 2}", "--moba_topk=2"]


def train_case(name: str, b: BenchConfig, out: Path) -> list[dict]:
    device, dtype = torch.device(b.device), torch.bfloat16
    layers = [f"--n_layer={b.train_layers}"] if b.train_layers else []
    cfg = load_config(["configs/bridges/owt_124m_full.py", *train_settings(name, b), *layers, f"--compile={b.train_compile}",
                       "--activation_checkpointing=none", "--parallelism=ddp", "--dropout=0.0"])
    torch.manual_seed(0)
    model = GPT(cfg.model).to(device)
    optimizer = model.configure_optimizer(0.1, 1e-4, (0.9, 0.95), device.type)
    step_fn = parallelize(model, cfg.train, device, dtype, distributed=False)
    x = torch.randint(0, cfg.model.vocab_size, (1, cfg.model.block_size + 1), device=device)

    def step():
        with torch.autocast(device.type, dtype=dtype):
            _, loss = step_fn(x[:, :-1], x[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    progress(f"{name} built")
    for _ in range(3):
        step()
        progress(f"{name} warm-up step")
    times = []
    release_memory()
    with TurnToTime(out):
        step()  # untimed: the allocator's blocks again
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        for _ in range(b.train_steps):
            t0 = time.perf_counter()
            step()
            synchronize()
            times.append(time.perf_counter() - t0)
        profile = profile_steps(step, 3) if name in b.train_profile.split(",") else []
    seconds = sorted(times)[len(times) // 2]
    tokens_per_s = cfg.model.block_size / seconds
    peak = peak_flops(device, dtype)
    return [{"variant": name, "tokens": cfg.model.block_size, "step_ms": 1000 * seconds, "tokens_per_s": tokens_per_s,
             "mfu": model.flops_per_token(cfg.model.block_size) * tokens_per_s / peak if peak else 0.0,
             "max_memory_gib": max_memory_gib(), "profile": profile,
             "layers": sorted({type(block.mixer).__name__ for block in model.blocks})}]


def profile_steps(step, steps: int, top: int = 15) -> list[dict]:
    """The device kernels that took the most time over `steps` steps (ms per step each), from torch.profiler: where
    a step's time goes when the attention kernel's own time does not explain it."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        synchronize()
    device_time = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, device_time, 0), reverse=True)[:top]
    return [{"kernel": e.key[:90], "ms_per_step": getattr(e, device_time, 0) / 1000 / steps,
             "calls_per_step": e.count / steps} for e in rows]


def nanogpt_case(name: str, b: BenchConfig, out: Path) -> list[dict]:
    """train.py's layout, our model compiled whole and nanoGPT's compiled whole, on the same batches, alternating."""
    device, dtype = torch.device(b.device), torch.bfloat16
    spec = importlib.util.spec_from_file_location("nanogpt_model", b.nanogpt)
    nano = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nano)
    layers = [f"--n_layer={b.train_layers}"] if b.train_layers else []
    cfg = load_config(["configs/bridges/owt_124m_full.py", *layers, "--compile=True", "--activation_checkpointing=none",
                       "--parallelism=ddp", "--dropout=0.0"])
    m = cfg.model
    models = {}
    torch.manual_seed(0)
    ours = GPT(m).to(device)
    models["train.py's layout"] = (ours, parallelize(ours, cfg.train, device, dtype, distributed=False),
                                   ours.configure_optimizer(0.1, 1e-4, (0.9, 0.95), device.type))
    whole = GPT(m).to(device)
    models["this model compiled whole"] = (whole, torch.compile(whole),
                                           whole.configure_optimizer(0.1, 1e-4, (0.9, 0.95), device.type))
    reference = nano.GPT(nano.GPTConfig(block_size=m.block_size, vocab_size=m.vocab_size, n_layer=m.n_layer,
                                        n_head=m.n_head, n_embd=m.n_embd, dropout=0.0, bias=m.bias)).to(device)
    models["nanoGPT's model.py compiled whole"] = (reference, torch.compile(reference),
                                                   reference.configure_optimizers(0.1, 1e-4, (0.9, 0.95), device.type))
    x = torch.randint(0, m.vocab_size, (b.nanogpt_batch, m.block_size + 1), device=device)
    inputs, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()  # as nanoGPT's get_batch makes them

    def step(forward, optimizer):
        with torch.autocast(device.type, dtype=dtype):
            _, loss = forward(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for label, (_, forward, optimizer) in models.items():
        for _ in range(3):
            step(forward, optimizer)
        progress(f"{label} warm")
    times = {label: [] for label in models}
    release_memory()
    with TurnToTime(out):
        for _, forward, optimizer in models.values():
            step(forward, optimizer)  # untimed: the allocator's blocks again
        for _ in range(b.nanogpt_steps):
            for label, (_, forward, optimizer) in models.items():
                synchronize()
                t0 = time.perf_counter()
                step(forward, optimizer)
                synchronize()
                times[label].append(time.perf_counter() - t0)
    tokens = b.nanogpt_batch * m.block_size
    results = []
    for label, seconds in times.items():
        median = sorted(seconds)[len(seconds) // 2]
        results.append({"model": label, "step_ms": 1000 * median, "tokens_per_s": tokens / median,
                        "params_M": sum(p.numel() for p in models[label][0].parameters()) / 1e6})
    return results


CASES = {"kernels": kernel_case, "train": train_case, "nanogpt": nanogpt_case}


# ---- the driver --------------------------------------------------------------------------------------------------

def default_variants() -> tuple[list[str], list[str]]:
    """(kernel cases, training variants) from the registry: every case whose layer is attention (its kernel is
    what the kernels table times) with FlexAttention's baselines, and every attention mixer and pattern alias."""
    attention = lambda names: all(issubclass(MIXERS[n], Attention) for n in names)  # noqa: E731
    kernels = [name for name, settings in example_cases(256).items()
               if len(pattern_names(settings["attn_pattern"])) == 1 and attention(pattern_names(settings["attn_pattern"]))]
    train = [name for name, cls in MIXERS.items() if issubclass(cls, Attention)] + list(PATTERN_ALIASES)
    return kernels + list(FLEX_BASELINES), train


def jobs(b: BenchConfig) -> list[tuple[str, str]]:
    parts = b.parts.split(",")
    kernels, train = default_variants()
    out = []
    if "kernels" in parts:
        out += [("kernels", v) for v in (b.kernel_variants.split(",") if b.kernel_variants else kernels)]
    if "train" in parts:
        out += [("train", v) for v in (b.train_variants.split(",") if b.train_variants else train)]
    if "nanogpt" in parts and b.nanogpt:
        out.append(("nanogpt", "gpt2_124m"))
    return out


GO = "all"  # the driver's file in OUT/ready: every case is warm, timing may begin


def run_jobs(b: BenchConfig, argv: list[str], out: Path) -> dict:
    """Every case in its own process, in rounds of --jobs: a round's cases warm up at once (compiling into the
    caches on disk), and once all are warm (or --ready_by has passed: the late ones are stopped and reported) they
    time one after another. A round ends before the next starts, so only --jobs cases hold GPU memory at a time
    (every case of a default run held at once overflowed an 80 GiB H100). What each wrote, or why it did not."""
    started, pending, results = time.time(), list(jobs(b)), {}
    rounds = -(-len(pending) // b.jobs)
    for number in range(1, rounds + 1):
        if time.time() - started > b.timeout:
            for part, name in pending:
                results[(part, name)] = {"error": f"not started before --timeout={b.timeout} s"}
            break
        batch, pending = pending[:b.jobs], pending[b.jobs:]
        print(f"[{time.time() - started:5.0f} s] round {number}/{rounds}: "
              f"{', '.join(f'{part}:{name}' for part, name in batch)}", flush=True)
        for old in (out / "ready").iterdir():  # the last round's marks, GO among them
            old.unlink()
        results.update(run_round(b, argv, out, batch, started))
    print(f"[{time.time() - started:5.0f} s] done", flush=True)
    return results


def run_round(b: BenchConfig, argv: list[str], out: Path, batch: list[tuple[str, str]], started: float) -> dict:
    procs, round_started = {}, time.time()
    for part, name in batch:
        log = open(out / "logs" / f"{part}_{safe(name)}.log", "w")
        env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               "GPU_BENCH_JOB": f"{part}_{name}"}
        # VARIANT@MxNxWARPSxSTAGES: span attention's tiles for this case, which attention/ops/span/op.py reads when
        # it is imported (as config is, before main runs): set in the case's environment before it starts
        tiles = name.partition("@")[2]
        if tiles:
            env[TILES_ENV] = tiles.replace("x", ",")
        procs[(part, name)] = (subprocess.Popen([sys.executable, "-m", "scripts.gpu_bench", *argv,
                                                 f"--job={part}:{name}"], stdout=log, stderr=subprocess.STDOUT,
                                                env=env), log)
    while True:  # warm ones wait for the rest of their round
        waiting = [key for key, (proc, _) in procs.items()
                   if proc.poll() is None and not (out / "ready" / safe(f"{key[0]}_{key[1]}")).exists()]
        if not waiting or time.time() - round_started > b.ready_by:
            break
        time.sleep(0.5)
    for key in waiting:  # not warm in time: stopped, so that no timing runs beside its warm-up
        procs[key][0].kill()
    (out / "ready" / GO).touch()
    results = {}
    for (part, name), (proc, log) in procs.items():
        try:
            proc.wait(timeout=max(1, b.timeout - (time.time() - started)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        path = out / "results" / f"{part}_{safe(name)}.json"
        if path.exists():
            results[(part, name)] = json.loads(path.read_text())
        elif (part, name) in waiting:
            results[(part, name)] = {"error": f"not warm after --ready_by={b.ready_by} s: stopped"}
        else:
            tail = (out / "logs" / f"{part}_{safe(name)}.log").read_text()[-1500:]
            results[(part, name)] = {"error": f"exit {proc.returncode}: {tail}"}
    return results


def safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def kernel_tables(rows: list[dict]) -> list[str]:
    lines = []
    for n in sorted({r["n"] for r in rows}):
        at = {r["variant"]: r for r in rows if r["n"] == n}
        full, swa = at.get("full"), at.get("swa")
        table = []
        for name, r in at.items():
            per_edge = (r["ms"] / r["edges_per_head"]) / (swa["ms"] / swa["edges_per_head"]) \
                if swa and r.get("edges_per_head") else None
            table.append([name, r["backend"], f"{r['ms']:.2f}", f"{full['ms'] / r['ms']:.2f}x" if full else "",
                          f"{r['ms'] / swa['ms']:.2f}" if swa else "", f"{per_edge:.2f}" if per_edge else "-",
                          f"{r['scores_per_edge']:.2f}" if r.get("scores_per_edge") else "-"])
        lines += [f"n = {n}:", "", markdown_table(["variant", "kernel", "ms (fwd+bwd)", "speed vs full", "time / swa",
                                                    "time per allowed edge / swa", "scores / edges"], table), ""]
    return lines


def train_table(rows: list[dict]) -> list[str]:
    full = next((r for r in rows if r["variant"] == "full"), None)
    table = [[r["variant"], f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:,.0f}",
              f"{r['tokens_per_s'] / full['tokens_per_s']:.2f}x" if full else "", f"{100 * r['mfu']:.1f}%",
              f"{r['max_memory_gib']:.1f}"] for r in rows]
    return [markdown_table(["variant", "step ms", "tokens/s", "vs full", "MFU", "max GiB"], table)]


def nanogpt_table(rows: list[dict]) -> list[str]:
    reference = next(r for r in rows if r["model"].startswith("nanoGPT"))
    table = [[r["model"], f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:,.0f}",
              f"{r['tokens_per_s'] / reference['tokens_per_s']:.3f}x"] for r in rows]
    return [markdown_table(["model", "step ms", "tokens/s", "vs nanoGPT"], table)]


def main(argv):
    b = exit_on_config_error(parse, argv)
    out = Path(b.out)
    if b.job:
        part, _, job = b.job.partition(":")
        name, _, tiles = job.partition("@")  # VARIANT@MxNxWARPSxSTAGES: tiles set by the driver (run_jobs)
        results = CASES[part](name, b, out)
        if tiles:
            for row in results:
                row["variant"] = job
        write_json(results, out / "results" / f"{part}_{safe(job)}.json")
        return
    if b.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: the GPU benchmark needs CUDA (torch " + torch.__version__ + " sees no GPU): run it on a GPU "
                 "machine; python -m scripts.bench_attention and scripts.bench_train measure on the CPU")
    claim_own_folder(out, OUTPUT_MARKER)
    for sub in ("logs", "results", "ready"):  # its own files from an earlier run (the folder is its own)
        (out / sub).mkdir(parents=True, exist_ok=True)
        for old in (out / sub).iterdir():
            old.unlink()
    import triton

    where = torch.cuda.get_device_name() if b.device == "cuda" else "CPU (a check of the script, not a measurement)"
    header = (f"{where}, torch {torch.__version__}, Triton {triton.__version__}; "
              f"kernels: B={b.batch} H={b.heads} d={b.head_dim} bf16, window {b.window}")
    print(header, flush=True)
    started = time.time()
    results = run_jobs(b, argv, out)
    report = [f"# GPU benchmark ({time.strftime('%Y-%m-%d')})", "", header,
              f"command: python -m scripts.gpu_bench {' '.join(argv)}", f"wall time: {time.time() - started:.0f} s", ""]
    errors = {f"{part}:{name}": r["error"] for (part, name), r in results.items() if isinstance(r, dict)}
    kernels = [row for (part, _), r in results.items() if part == "kernels" and isinstance(r, list) for row in r]
    train = [row for (part, _), r in results.items() if part == "train" and isinstance(r, list) for row in r]
    nano = [row for (part, _), r in results.items() if part == "nanogpt" and isinstance(r, list) for row in r]
    if kernels:
        report += ["## Attention kernels, forward + backward", "", *kernel_tables(kernels)]
    if train:
        report += [f"## Training GPT-2 124M at {b.train_len} tokens, batch 1, windows and blocks {b.train_window}, "
                   "compiled bf16", "", *train_table(train), ""]
    for row in train:
        if row.get("profile"):
            report += [f"### Where {row['variant']}'s training step spends its time (top kernels, ms per step)", "",
                       markdown_table(["kernel", "ms / step", "calls / step"],
                                      [[p["kernel"], f"{p['ms_per_step']:.3f}", f"{p['calls_per_step']:.0f}"]
                                       for p in row["profile"]]), ""]
    if nano:
        report += ["## GPT-2 124M, batch 16 x 1024, against nanoGPT's model.py", "", *nanogpt_table(nano), ""]
    elif "nanogpt" in b.parts.split(","):
        report += ["nanogpt: left out (give --nanogpt=PATH to nanoGPT's model.py)", ""]
    for job, error in errors.items():
        report += [f"{job}: FAILED {error}", ""]
    text = "\n".join(report)
    print(text)
    (out / "report.md").write_text(text + "\n")
    write_json({"header": header, "config": asdict(b), "kernels": kernels, "train": train, "nanogpt": nano,
                "errors": errors}, out / "gpu_bench.json")
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main(sys.argv[1:])
