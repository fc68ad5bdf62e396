"""The steps that run one of the project's tools under scripts/ (bench_attention, bench_train, compile_check,
bench_generate) in a process of its own and summarize the JSON it writes."""

import json
import shlex
from pathlib import Path

from scripts.gpucheck.context import StepContext, outcome
from scripts.gpucheck.options import PAPER_000_TABLE_2


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
