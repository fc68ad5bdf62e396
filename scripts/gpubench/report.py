"""The benchmark's report: the cases' rows gathered by part, and the tables printed and written to OUT/report.md
(each variant against full attention and swa's time per allowed edge, training speed and MFU, where the profiled
steps spend their time, train.py's step against nanoGPT's)."""

from __future__ import annotations

import time

from common.outputs import markdown_table
from scripts.gpubench.options import BenchConfig


def collect(results: dict) -> dict:
    """{"kernels", "train", "nanogpt": every row the cases of that part returned, "errors": {PART:NAME: why}}."""
    rows = {part: [row for (p, _), r in results.items() if p == part and isinstance(r, list) for row in r]
            for part in ("kernels", "train", "nanogpt")}
    return {**rows, "errors": {f"{part}:{name}": r["error"] for (part, name), r in results.items()
                               if isinstance(r, dict)}}


def report(b: BenchConfig, argv: list[str], header: str, wall_s: float, rows: dict) -> str:
    """The report's markdown: a section per part that has rows, and each case that failed with why."""
    kernels, train, nano = rows["kernels"], rows["train"], rows["nanogpt"]
    lines = [f"# GPU benchmark ({time.strftime('%Y-%m-%d')})", "", header,
             f"command: python -m scripts.gpu_bench {' '.join(argv)}", f"wall time: {wall_s:.0f} s", ""]
    if kernels:
        lines += ["## Attention kernels, forward + backward", "", *kernel_tables(kernels)]
    if train:
        how = ("compiled bf16 with CUDA graphs (--train_cuda_graphs: mode=reduce-overhead)" if b.train_cuda_graphs
               else "compiled bf16" if b.train_compile else "eager bf16")
        lines += [f"## Training GPT-2 124M at {b.train_len} tokens, batch 1, windows and blocks {b.train_window}, "
                  f"{how}", "", *train_table(train), "",
                  "host ms: the host's time to enqueue a step (until zero_grad returns, before synchronising); GPU "
                  "busy ms: the time some kernel ran, per profiled step (--train_profile). A host time near the "
                  "step's and a GPU busy time well below it: the step is bound by the host's kernel launches "
                  "(--train_cuda_graphs replays them). vs full: against full attention with the case's own "
                  "settings (VARIANT:KEY=VALUE). max GiB: the peak allocated in the timed steps; with CUDA graphs, at "
                  "least the memory reserved (the graphs' pools hold theirs from the recording).", ""]
    for row in train:
        if row.get("profile"):
            lines += [f"### Where {row['variant']}'s training step spends its time (top kernels, ms per step)", "",
                      markdown_table(["kernel", "ms / step", "calls / step"],
                                     [[p["kernel"], f"{p['ms_per_step']:.3f}", f"{p['calls_per_step']:.0f}"]
                                      for p in row["profile"]]), ""]
    if nano:
        lines += ["## GPT-2 124M, batch 16 x 1024, against nanoGPT's model.py", "", *nanogpt_table(nano), ""]
    elif "nanogpt" in b.parts.split(","):
        lines += ["nanogpt: left out (give --nanogpt=PATH to nanoGPT's model.py)", ""]
    for job, error in rows["errors"].items():
        lines += [f"{job}: FAILED {error}", ""]
    return "\n".join(lines)


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
    by_name = {r["variant"]: r for r in rows}

    def full(name):  # full attention with the case's own settings (VARIANT:KEY=VALUE), else plain
        settings = name.partition(":")[2]
        return by_name.get(f"full:{settings}" if settings else "full") or by_name.get("full")

    def ms(value):  # rows of older results lack the host's and the GPU's times
        return "-" if value is None else f"{value:.1f}"
    table = [[r["variant"], f"{r['step_ms']:.1f}", ms(r.get("host_ms")), ms(r.get("gpu_busy_ms")),
              f"{r['tokens_per_s']:,.0f}",
              f"{r['tokens_per_s'] / full(r['variant'])['tokens_per_s']:.2f}x" if full(r["variant"]) else "",
              f"{100 * r['mfu']:.1f}%", f"{r['max_memory_gib']:.1f}"] for r in rows]
    return [markdown_table(["variant", "step ms", "host ms", "GPU busy ms", "tokens/s", "vs full", "MFU", "max GiB"],
                           table)]


def nanogpt_table(rows: list[dict]) -> list[str]:
    reference = next(r for r in rows if r["model"].startswith("nanoGPT"))
    table = [[r["model"], f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:,.0f}",
              f"{r['tokens_per_s'] / reference['tokens_per_s']:.3f}x"] for r in rows]
    return [markdown_table(["model", "step ms", "tokens/s", "vs nanoGPT"], table)]
