"""Forward + backward time and peak memory of attention variants against full causal SDPA.

    python scripts/bench_attention.py                                     # CPU: n = 1K..32K, B=1, H=8, d_h=64
    python scripts/bench_attention.py --device=cuda --batch=16 --heads=16 --dtype=bfloat16 --json=out/bench_gpu.json
    python scripts/bench_attention.py --variants=swa,block --lengths=4096,16384 --window=128
    python scripts/bench_attention.py --variants=full,swa,sa,sa_swa --lengths=2048,4096,8192,16384,32768
    python scripts/bench_attention.py --variants=swa,swat,swat_softmax --lengths=4096,16384
    python scripts/bench_attention.py --variants=swa,mlstm,gated_deltanet --lengths=2048,4096,8192,16384
    python scripts/bench_attention.py --variants=block,swa,bridge,pbb,se_bridge --window=128 --block=128

Each variant runs its attention kernel (q, k, v -> output, the same dispatch the model's layers use, with
`--backend`, default auto: flex on CUDA, chunked on CPU, SDPA for full) on random inputs; the projections,
identical across variants, are left out (sa draws a fresh permutation and gathers / scatters inside each
step, as its layer does; sa_swa runs both paths; swat is sigmoid attention with balanced ALiBi in the
kernel, swat_softmax its softmax counterpart; mlstm and gated_deltanet run their chunkwise training forms, with
q, k of head_dim / 2 for mlstm as in xLSTM 7B and random gates; bridge, pbb and se_bridge run block(--block)
plus their bridge path, with w = --window and e = --window / 2, in the branch form). Time is the best of --repeats timed runs after one warmup (the least
disturbed by other work on the machine; the JSON keeps every run). Peak
memory is the extra memory a forward + backward takes: torch.cuda.max_memory_allocated on GPUs; on CPU each
case runs in its own process and reports its resident-set high-water mark above the inputs.
"""

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attention.edges import (AnyOf, BoundaryWindows, Causal, FixedBlock, HeadWindows, PermutedWindow,  # noqa: E402
                             SlidingWindow)
from attention.gated_deltanet import chunked_gated_delta_rule, fla_chunk_kernel  # noqa: E402
from attention.kernels import attend, resolve_backend  # noqa: E402
from attention.mlstm import mlstm_sequence  # noqa: E402
from attention.stochastic import stochastic_attention  # noqa: E402
from attention.swat import AlibiBias, swat_slopes  # noqa: E402
from checkpoint import write_json  # noqa: E402
from config import ConfigError, apply_args, dataclass_fields, exit_on_config_error  # noqa: E402
from machine import busy_note  # noqa: E402


@dataclass
class BenchConfig:
    variants: str = "full,swa,block"
    lengths: str = "1024,2048,4096,8192,16384,32768"
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    window: int = 256  # swa(w)
    block: int = 256  # block(b)
    dtype: str = "float32"
    device: str = "auto"
    backend: str = "auto"  # for the variants; full always runs PyTorch's causal SDPA
    chunk: int = 64  # mlstm, gated_deltanet: chunk length of the chunkwise form
    repeats: int = 5
    # CPU: glibc malloc keeps freed memory instead of unmapping blocks above its mmap threshold, so a step's
    # large temporaries are not page-faulted in afresh every time (on this project's VM that first touch
    # dominated the chunked recurrent forms beyond n = 8K); "default" measures with glibc's defaults
    cpu_malloc: str = "keep"
    json: str = ""
    case: str = ""  # internal: run one "variant:n" case and print its JSON


RECURRENT = ("mlstm", "gated_deltanet")  # linear-RNN mixers: no edge rule, O(n) chunkwise forms
BRIDGES = ("bridge", "pbb", "se_bridge")


def bridge_path(kind: str, b: "BenchConfig"):
    return BoundaryWindows(kind, b.block, b.window // 2 if kind == "se_bridge" else b.window, 1 << 20)


def rule_of(name: str, b: BenchConfig):
    # mswa: the layer of an MSWA stack whose base window is w (heads w/4, w/2, w, 2w; summed windows 15/16 of swa)
    quarter = b.heads // 4 or 1
    mswa = HeadWindows(tuple(int(b.window * f) for f in (0.25, 0.5, 1, 2) for _ in range(quarter))[:b.heads])
    # sa, sa_swa: the permuted-space band of stochastic attention (a fresh permutation every step)
    rules = {"full": Causal(), "swa": SlidingWindow(b.window), "block": FixedBlock(b.block), "mswa": mswa,
             "sa": PermutedWindow(torch.arange(2), b.window), "sa_swa": SlidingWindow(b.window),
             "swat": SlidingWindow(b.window), "swat_softmax": SlidingWindow(b.window)}
    for kind in BRIDGES:  # paper 004 (branch form: the block path plus the bridge path; w = window, e = window / 2)
        rules[kind] = AnyOf((FixedBlock(b.block), bridge_path(kind, b)))
    if name in RECURRENT:
        return Causal()  # every earlier token reaches the state
    if name not in rules:
        raise ConfigError(f"unknown variant {name!r}: expected one of {', '.join([*rules, *RECURRENT])}")
    return rules[name]


def recurrent_of(name: str, b: BenchConfig, n: int, device, dtype):
    """q, k, v -> output of a recurrent mixer's training form, with its gates as extra inputs: on CUDA the GPU
    kernel the layer trains with when it is installed (mlstm_kernels' Triton mLSTM, fla's Gated DeltaNet), q, k,
    v in their own dtype as the layer passes them under autocast."""
    gate = lambda scale, shift: (torch.randn(b.batch, b.heads, n, device=device) * scale + shift).requires_grad_()
    if name == "mlstm":  # input gates near their initialisation (bias -10), forget gates near 3..6
        i, f = gate(2, -10), gate(1, 4)
        half = b.head_dim // 2
        return lambda q, k, v: mlstm_sequence(q[..., :half], k[..., :half], v, i, f, chunk=b.chunk,
                                              need_state=False)[0]
    g, beta = gate(0.5, -3), gate(1, 0)  # log decay softplus-shaped below 0, beta through a sigmoid
    fla = fla_chunk_kernel() if torch.device(device).type == "cuda" else None

    def gated_deltanet(q, k, v):
        decay = -torch.nn.functional.softplus(-g)
        if fla is not None:  # (B, T, H, D) layout; the kernel normalises q and k itself
            layout = lambda t: t.transpose(1, 2).contiguous()  # noqa: E731
            y, _ = fla(layout(q), layout(k), layout(v), layout(decay), layout(torch.sigmoid(beta).to(v.dtype)),
                       scale=b.head_dim ** -0.5, use_qk_l2norm_in_kernel=True)
            return y.transpose(1, 2)
        q, k = (torch.nn.functional.normalize(t.float(), dim=-1) for t in (q, k))
        return chunked_gated_delta_rule(q * b.head_dim ** -0.5, k, v.float(), decay, torch.sigmoid(beta),
                                        chunk=b.chunk)[0]
    return gated_deltanet


def attention_of(name: str, b: BenchConfig, backend: str, device=None, n: int = 0, dtype=torch.float32):
    """q, k, v -> output as the variant's layer computes it (sa draws its permutation inside the step)."""
    if name in RECURRENT:
        return recurrent_of(name, b, n, device, dtype)
    rule = rule_of(name, b)

    def sa(q, k, v):
        order = torch.randperm(q.shape[2], device=q.device)
        return stochastic_attention(q, k, v, order, b.window, backend)

    if name == "sa":
        return sa
    if name == "sa_swa":  # both paths over the same q, k, v (their gates are projections, left out)
        return lambda q, k, v: sa(q, k, v) + attend(q, k, v, rule, backend)
    if name in BRIDGES:  # two separately normalised paths, summed (the layer's branch fusion)
        paths = (FixedBlock(b.block), bridge_path(name, b))
        return lambda q, k, v: sum(attend(q, k, v, path, backend) for path in paths)
    if name in ("swat", "swat_softmax"):  # balanced ALiBi (half the heads each way) inside the kernel
        alibi = AlibiBias(torch.tensor(swat_slopes(b.heads, "paper", ""), device=device), 0.0)
        activation = "sigmoid" if name == "swat" else "softmax"
        return lambda q, k, v: attend(q, k, v, rule, backend, score_mod=alibi, activation=activation)
    return lambda q, k, v: attend(q, k, v, rule, backend)


def rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def run_case(name: str, n: int, b: BenchConfig, device: torch.device) -> dict:
    rule = rule_of(name, b)
    backend = "sdpa" if name == "full" else "chunked" if name in RECURRENT else resolve_backend(b.backend, rule, device)
    dtype = getattr(torch, b.dtype)
    shape = (b.batch, b.heads, n, b.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=dtype)

    attention = attention_of(name, b, backend, device, n, dtype)

    def step():
        out = attention(q, k, v)
        out.backward(grad)
        q.grad = k.grad = v.grad = None

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
    return {"variant": name, "backend": backend, "n": n, "ms": 1000 * min(times),
            "runs_ms": [round(1000 * t, 1) for t in times], "peak_mib": peak / 2**20}


def parse(argv) -> BenchConfig:
    b = BenchConfig()
    apply_args(b, argv, dataclass_fields(BenchConfig))
    for name in b.variants.split(","):
        rule_of(name, b)
    if b.repeats < 1:
        raise ConfigError("repeats must be >= 1")
    if b.cpu_malloc not in ("keep", "default"):
        raise ConfigError(f"cpu_malloc={b.cpu_malloc!r}: expected keep or default")
    return b


def main(argv):
    b = exit_on_config_error(parse, argv)
    device = torch.device(b.device if b.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if b.case:
        name, n = b.case.split(":")
        print(json.dumps(run_case(name, int(n), b, device)))
        return
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    if busy_note(torch.get_num_threads()):
        print(busy_note(torch.get_num_threads()))
    print(f"device: {where}; B={b.batch} H={b.heads} d_h={b.head_dim} {b.dtype}; window {b.window}, "
          f"block {b.block}; torch {torch.__version__}" + (f"; malloc {b.cpu_malloc}" if device.type == "cpu" else ""))
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
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, f"--case={name}:{n}"],
                                      capture_output=True, text=True, env=env)
                if proc.returncode != 0:
                    raise SystemExit(f"case {name}:{n} failed:\n{proc.stderr[-2000:]}")
                r = json.loads(proc.stdout.strip().splitlines()[-1])
            results.append(r)
            full = next((x for x in results if x["variant"] == "full" and x["n"] == n), None)
            r["speedup_vs_full"] = full["ms"] / r["ms"] if full else None
            print(f"n={n:>6} {name:<14} {r['backend']:<8} {r['ms']:>10.1f} ms {r['peak_mib']:>9.1f} MiB"
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
