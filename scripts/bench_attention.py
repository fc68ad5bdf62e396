"""Forward + backward time and peak memory of the variants' token-mixing kernels against full causal SDPA.

    python -m scripts.bench_attention                                     # CPU: n = 1K..32K, B=1, H=8, d_h=64
    python -m scripts.bench_attention --device=cuda --batch=16 --heads=16 --dtype=bfloat16 --json=out/bench_gpu.json
    python -m scripts.bench_attention --variants=swa,block --lengths=4096,16384 --window=128
    python -m scripts.bench_attention --variants=full,swa,sa,sa_swa --lengths=2048,4096,8192,16384,32768
    python -m scripts.bench_attention --variants=swa,swat,swat_softmax --lengths=4096,16384
    python -m scripts.bench_attention --variants=swa,mlstm,gated_deltanet --lengths=2048,4096,8192,16384
    python -m scripts.bench_attention --variants=block,swa,bridge,pbb,se_bridge --window=128
    python -m scripts.bench_attention --variants=swa,mlstm:mlstm_chunk=128               # a case with a setting

A variant is any case of the mixer registry (attention/registry.py: example_cases: every registered mixer with its
example settings at --window, each of its check_variants such as swat_softmax or pbb_union), optionally followed by
:KEY=VALUE model settings. Each runs the layer's own kernel (kernel_inputs and kernel_forward, its KernelBench
capability: q, k, v -> output, the same dispatch and plan the model's layers use, with `--backend`, default auto:
SDPA for full; on CUDA span attention's Triton kernel for every rule whose edges are spans (sliding windows,
multi-scale windows, blocks, the bridges' windows, sa's band, swat's sigmoid with ALiBi) when Triton is installed,
FlexAttention for the other rules and where Triton is missing; block-sparse chunked on the CPU) on random inputs,
the layer built as the last layer of a model of --heads heads of --head_dim (for MSWA the deepest, whose heads have
windows w/4 .. 2w); the projections, identical across variants, are left out (sa draws a fresh permutation and
gathers / scatters inside each step, as its layer does; sa_swa runs both paths; the recurrent mixers run their
training forms on random gates). Time is the best of --repeats timed runs after one warmup (the least disturbed by
other work on the machine; the JSON keeps every run). scores/edges is what the kernel evaluates (every tile or block
of its plan: attention/kernels.py computed_scores) over the edges the rule allows ("-" where a mixer plans no
attention kernel). Peak memory is the extra memory a forward + backward takes: torch.cuda.max_memory_allocated on
GPUs; on CPU each case runs in its own process and reports its resident-set high-water mark above the inputs.
"""

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

if not __package__:  # run as a file, the project's modules cannot be imported: say how to run it
    sys.exit("run it from the repository root as a module: python -m scripts.bench_attention ...")

from attention.capabilities import EdgeCounts, KernelBench  # noqa: E402
from attention.kernels import layer_scores, plans_in  # noqa: E402
from attention.registry import build_mixer, example_cases  # noqa: E402
from config import (Config, ConfigError, ModelConfig, apply_args, dataclass_fields,  # noqa: E402
                    exit_on_config_error, set_value, validate)
from common.machine import busy_note  # noqa: E402
from common.outputs import write_json  # noqa: E402


@dataclass
class BenchConfig:
    variants: str = "full,swa,block"  # cases of the registry, each optionally with :KEY=VALUE settings
    lengths: str = "1024,2048,4096,8192,16384,32768"
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    window: int = 256  # the windows and blocks of the cases (their example settings)
    dtype: str = "float32"
    device: str = "auto"
    backend: str = "auto"  # attn_backend of the attention variants; full always runs PyTorch's causal SDPA
    repeats: int = 5
    # CPU: glibc malloc keeps freed memory instead of unmapping blocks above its mmap threshold, so a step's
    # large temporaries are not page-faulted in afresh every time (on this project's VM that first touch
    # dominated the chunked recurrent forms beyond n = 8K); "default" measures with glibc's defaults
    cpu_malloc: str = "keep"
    json: str = ""
    case: str = ""  # internal: run one "variant:n" case and print its JSON


def variant_config(spec: str, b: BenchConfig, n: int) -> ModelConfig:
    """The model of a variant spec (CASE[:KEY=VALUE...]), checked as a training config is (n: the length)."""
    name, *pairs = spec.split(":")
    cases = example_cases(b.window)
    if name not in cases:
        raise ConfigError(f"unknown variant {name!r}: expected one of {', '.join(cases)} (the mixer registry's cases)")
    settings = {"n_layer": 1, **cases[name]}
    cfg = Config()
    m = cfg.model
    # a context far beyond n: kernels as at any training length (the bridges' boundaries all the way)
    for key, value in {"n_head": b.heads, "n_embd": b.heads * b.head_dim, "block_size": 1 << 20, "arch": "llama",
                       "bias": False, "vocab_size": 64, **settings}.items():
        setattr(m, key, value)
    if "attn_backend" in {f for f in dataclass_fields(ModelConfig)} and b.backend != "auto" and name != "full":
        m.attn_backend = b.backend
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError(f"variant {spec!r}: settings are written CASE:KEY=VALUE")
        set_value(m, key, value, dataclass_fields(ModelConfig))
    validate(cfg)
    return m


def backend_of(mixer, n: int, device) -> str:
    """The kernels the mixer's plan picks at this length (attention under edge rules), "triton" where the plan is
    only whether the layer's own Triton kernels run (MoBA), else "native" (its own)."""
    try:
        plans = mixer.plan(1, n, device)
    except Exception:
        plans = None
    kernels = [plan.kernel for plan in plans_in(plans)]
    if not kernels and plans is True:
        return "triton"
    return "+".join(dict.fromkeys(kernels)) or "native"


def rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def run_case(name: str, n: int, b: BenchConfig, device: torch.device) -> dict:
    m = variant_config(name, b, n)
    dtype = getattr(torch, b.dtype)
    with torch.device(device):
        mixer = build_mixer(m, m.n_layer - 1)  # the last layer (MSWA's deepest)
    mixer = mixer.to(device)
    if not isinstance(mixer, KernelBench):
        raise SystemExit(f"{name}: {type(mixer).__name__} does not expose its kernel: define kernel_inputs and "
                         "kernel_forward in its module (attention/capabilities.py: KernelBench)")
    inputs = mixer.kernel_inputs(b.batch, n, device, dtype)
    grad = None

    def attention(*tensors):
        return mixer.kernel_forward(*tensors)

    def step():
        nonlocal grad
        out = attention(*inputs)
        if grad is None:
            grad = torch.randn_like(out)
        out.backward(grad)
        for t in inputs:
            t.grad = None

    base = rss_kib() * 1024  # CPU: the inputs are allocated; the high-water mark above this is the step's
    step()  # warmup (and compilation, for flex)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(b.repeats):
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base)
    backend = backend_of(mixer, n, device)  # after the peak: its plan is the step's memory, not the inputs'
    # what the kernel evaluates against the edges the rule allows: a cost that does not follow the edges shows
    # recurrent mixers: a state, no attention edges
    edges = sum(e for _, e in mixer.edge_counts(n)) / m.n_head if isinstance(mixer, EdgeCounts) else None
    scores = layer_scores(mixer, n, device)[1]
    return {"variant": name, "backend": backend, "n": n, "ms": 1000 * min(times),
            "runs_ms": [round(1000 * t, 1) for t in times], "peak_mib": peak / 2**20,
            "scores_per_head": scores, "edges_per_head": edges,
            "scores_vs_edges": scores / edges if scores is not None and edges else None}


def parse(argv) -> BenchConfig:
    b = BenchConfig()
    apply_args(b, argv, dataclass_fields(BenchConfig))
    for name in b.variants.split(","):
        variant_config(name, b, max(int(x) for x in b.lengths.split(",")))
    if b.repeats < 1:
        raise ConfigError("repeats must be >= 1")
    if b.cpu_malloc not in ("keep", "default"):
        raise ConfigError(f"cpu_malloc={b.cpu_malloc!r}: expected keep or default")
    return b


def main(argv):
    b = exit_on_config_error(parse, argv)
    device = torch.device(b.device if b.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if b.case:
        name, _, n = b.case.rpartition(":")  # the case may carry settings: CASE:KEY=VALUE:n
        print(json.dumps(run_case(name, int(n), b, device)))
        return
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    if busy_note(torch.get_num_threads()):
        print(busy_note(torch.get_num_threads()))
    print(f"device: {where}; B={b.batch} H={b.heads} d_h={b.head_dim} {b.dtype}; window {b.window}; "
          f"torch {torch.__version__}" + (f"; malloc {b.cpu_malloc}" if device.type == "cpu" else ""))
    results = []
    lengths = [int(x) for x in b.lengths.split(",")]
    for n in lengths:
        for name in b.variants.split(","):
            if device.type == "cuda":
                r = run_case(name, n, b, device)
            else:  # a fresh process per case, so its memory high-water mark is its own
                env = dict(os.environ)
                if b.cpu_malloc == "keep":
                    env.update(MALLOC_MMAP_THRESHOLD_=str(2**31), MALLOC_TRIM_THRESHOLD_=str(2**31))
                proc = subprocess.run([sys.executable, "-m", "scripts.bench_attention", *argv, f"--case={name}:{n}"],
                                      capture_output=True, text=True, env=env,
                                      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
                if proc.returncode != 0:
                    raise SystemExit(f"case {name}:{n} failed:\n{proc.stderr[-2000:]}")
                r = json.loads(proc.stdout.strip().splitlines()[-1])
            results.append(r)
            full = next((x for x in results if x["variant"] == "full" and x["n"] == n), None)
            r["speedup_vs_full"] = full["ms"] / r["ms"] if full else None
            ratio = f"{r['scores_vs_edges']:5.2f}" if r.get("scores_vs_edges") else "    -"
            print(f"n={n:>6} {name:<14} {r['backend']:<8} {r['ms']:>10.1f} ms {r['peak_mib']:>9.1f} MiB "
                  f"scores/edges {ratio}"
                  + (f"  {r['speedup_vs_full']:5.1f}x vs full" if full and name != "full" else ""), flush=True)
    for name in b.variants.split(","):
        rows = {r["n"]: r for r in results if r["variant"] == name}
        growth = [f"{rows[m]['ms'] / rows[n]['ms']:.2f}x ({n}->{m})" for n, m in zip(lengths, lengths[1:])
                  if m == 2 * n]
        print(f"{name}: time growth per doubling of n: {', '.join(growth)}")
    if b.json:
        os.makedirs(os.path.dirname(b.json) or ".", exist_ok=True)
        write_json({"device": where, "torch": str(torch.__version__), "config": asdict(b), "results": results}, b.json)


if __name__ == "__main__":
    main(sys.argv[1:])
