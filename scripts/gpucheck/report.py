"""The GPU check's report: report.json and the markdown report.md, a section per step."""

from pathlib import Path

from common.outputs import atomic_write, markdown_table, write_json
from scripts.gpucheck.options import STEPS, TOLERANCE


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
            "and gradients, against `runtime/memory_plan.py`'s activations at their peak "
            f"({results['peak_moment']}) plus autocast's weight copies.", ""] + \
        _table(["config", "layers", "pattern", "tokens", "dtype", "measured", "planned", "measured / planned"], rows)


RENDERERS = {"gpu_tests": render_gpu_tests, "backends": render_backends, "bench_attention": render_bench_attention,
             "bench_train": render_bench_train, "train_runs": render_train_runs, "resume": render_resume,
             "memory": render_memory, "compile_check": render_compile_check, "generate": render_generate}
