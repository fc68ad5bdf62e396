"""What planning a layer costs on the host, cold: its plan, its edge counts and its score count, for every kernel
case of the GPU benchmark, on one CPU thread.

    python -m scripts.bench_plan                                    # every case at n = 32768 (about 20 s)
    python -m scripts.bench_plan --variants=swa,mswa --lengths=8192,32768 --json=out/bench_plan.json

A layer's plan (Mixer.plan: span attention's spans and backward plan, FlexAttention's block masks, the chunked
kernel's tiles) is built on the host before its first forward at each length, and its edge and score counts are
what the benchmarks and tools print beside it; all three are cached per (rule, length), so a run pays them once
per layer kind and length, at warm-up. Each case is scripts/gpu_bench.py's kernels case (the registry's example
cases at --window, the deepest layer of a model of --heads heads of --head_dim, built as
scripts/bench_attention.variant_config builds it, CASE:KEY=VALUE for settings) on the CUDA path, simulated on the
CPU (attention/simulate_cuda.py), so the plans are those a GPU run builds. Each figure is the best of --repeats
runs, each after clearing every per-(rule, length) cache of the attention package (its bounded functools caches:
static_spans, _static_problem, _count_edges, layout_groups, the block masks, ...), so it is the cold cost. Rows
with a figure over --budget_ms are marked (the target: planning costs nothing at warm-up). "scan ms" is what the
layer's span rules would cost written as allowed() alone: their spans and backward plan from a scan of their
edges (attention/ops/span/spans.py: scanned_spans) instead of the runs they state.
"""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import asdict, dataclass

import torch

if not __package__:  # run as a file, the project's modules cannot be imported: say how to run it
    sys.exit("run it from the repository root as a module: python -m scripts.bench_plan ...")

from attention import simulate_cuda  # noqa: E402
from attention.capabilities import EdgeCounts  # noqa: E402
from attention.kernels import layer_scores, plans_in  # noqa: E402
from attention.ops.span.spans import key_plan, scanned_spans  # noqa: E402
from attention.registry import build_mixer  # noqa: E402
from config import ConfigError, apply_args, dataclass_fields, exit_on_config_error  # noqa: E402
from common.outputs import markdown_table, write_json  # noqa: E402
from scripts.bench_attention import BenchConfig as AttentionConfig  # noqa: E402
from scripts.bench_attention import variant_config  # noqa: E402
from scripts.gpubench.options import default_variants  # noqa: E402

TIMED = ("plan_ms", "edges_ms", "scores_ms")  # the figures held to the budget (scan_ms is for comparison)


@dataclass
class BenchConfig:
    variants: str = ""  # cases of the registry, CASE:KEY=VALUE for settings; "": the GPU benchmark's kernel cases
    lengths: str = "32768"
    batch: int = 4
    heads: int = 16
    head_dim: int = 64
    window: int = 256
    repeats: int = 3  # each figure: the best of this many cold runs
    budget_ms: float = 50.0  # rows with a plan, edge count or score count slower than this are marked
    json: str = ""


def parse(argv) -> BenchConfig:
    b = BenchConfig()
    apply_args(b, argv, dataclass_fields(BenchConfig))
    if b.repeats < 1:
        raise ConfigError("repeats must be >= 1")
    lengths = [int(x) for x in b.lengths.split(",")]
    for name in cases(b):
        variant_config(name, attention_config(b), max(lengths))
    return b


def cases(b: BenchConfig) -> list[str]:
    return b.variants.split(",") if b.variants else default_variants()[0]


def attention_config(b: BenchConfig) -> AttentionConfig:
    return AttentionConfig(batch=b.batch, heads=b.heads, head_dim=b.head_dim, window=b.window, dtype="bfloat16")


def planning_caches() -> list:
    """Every per-(rule, length) cache of the attention package: its bounded functools caches (the unbounded ones
    are one-time probes, such as whether Triton is installed, not planning)."""
    caches = {}
    for name, module in list(sys.modules.items()):
        if name == "attention" or name.startswith("attention."):
            for value in vars(module).values():
                if isinstance(value, functools._lru_cache_wrapper) and value.cache_parameters()["maxsize"] is not None:
                    caches[id(value)] = value
    return list(caches.values())


def cold_ms(work, repeats: int) -> float:
    """The best time of `repeats` runs of work(), each after clearing every planning cache."""
    best = float("inf")
    for _ in range(repeats):
        for cache in planning_caches():
            cache.cache_clear()
        t0 = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - t0)
    return 1000 * best


def scan_rules(mixer, n: int) -> list:
    """The static rules the layer's plan runs as span attention (the rules whose spans a scan would find)."""
    plans = plans_in(mixer.plan(1, n, "cpu"))
    return [p.rule for p in plans if p.kernel == "span" and p.rule.static]


def run_case(name: str, n: int, b: BenchConfig) -> dict:
    m = variant_config(name, attention_config(b), n)
    mixer = build_mixer(m, m.n_layer - 1)  # the deepest layer (MSWA's widest windows), as gpu_bench times
    kernels = "+".join(dict.fromkeys(p.kernel for p in plans_in(mixer.plan(b.batch, n, "cpu")))) or "its own"
    row = {"variant": name, "n": n, "kernels": kernels,
           "plan_ms": cold_ms(lambda: mixer.plan(b.batch, n, "cpu"), b.repeats),
           "edges_ms": cold_ms(lambda: mixer.edge_counts(n), b.repeats) if isinstance(mixer, EdgeCounts) else None,
           "scores_ms": cold_ms(lambda: layer_scores(mixer, n, "cpu"), b.repeats)}
    rules = scan_rules(mixer, n)
    row["scan_ms"] = cold_ms(lambda: [key_plan(*scanned_spans(rule, n, m.n_head), n) for rule in rules],
                             b.repeats) if rules else None
    row["over_budget"] = over_budget(row, b.budget_ms)
    return row


def over_budget(row: dict, budget_ms: float) -> list[str]:
    """The figures of a row slower than the budget."""
    return [key.removesuffix("_ms") for key in TIMED if row[key] is not None and row[key] > budget_ms]


def table(results: list[dict], budget_ms: float) -> str:
    cell = lambda ms: "-" if ms is None else f"{ms:.1f}"  # noqa: E731
    rows = [[r["variant"], r["n"], r["kernels"], cell(r["plan_ms"]), cell(r["edges_ms"]), cell(r["scores_ms"]),
             cell(r["scan_ms"]), ("**" + ", ".join(r["over_budget"]) + "**") if r["over_budget"] else ""]
            for r in results]
    header = ["case", "n", "kernels", "plan ms", "edge counts ms", "scores ms", "scan ms", f"over {budget_ms:g} ms"]
    return markdown_table(header, rows, right={1, 3, 4, 5, 6}, aligned=True)


def main(argv):
    b = exit_on_config_error(parse, argv)
    torch.set_num_threads(1)
    results = []
    with simulate_cuda.simulating():  # layers resolve their kernels when built: build them inside
        for n in (int(x) for x in b.lengths.split(",")):
            for name in cases(b):
                results.append(run_case(name, n, b))
                print(f"{name} at n={n}: plan {results[-1]['plan_ms']:.1f} ms", file=sys.stderr, flush=True)
    print(f"Planning on the host, cold (best of {b.repeats}), one thread, the CUDA path simulated; "
          f"B={b.batch} H={b.heads} d_h={b.head_dim} window {b.window}; torch {torch.__version__}\n")
    print(table(results, b.budget_ms))
    over = [f"{r['variant']} (n={r['n']})" for r in results if r["over_budget"]]
    print(f"\nover {b.budget_ms:g} ms: {', '.join(over) if over else 'none'}")
    if b.json:
        write_json({"torch": str(torch.__version__), "threads": 1, "config": asdict(b), "results": results}, b.json)


if __name__ == "__main__":
    main(sys.argv[1:])
