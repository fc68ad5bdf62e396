"""scripts/bench_plan.py: every kernel case of the GPU benchmark planned cold on one thread, in a table that marks
what exceeds the budget."""

import json

import pytest

from conftest import load_script, run_in_process
from scripts.gpubench.options import default_variants


@pytest.mark.e2e
def test_the_benchmark_plans_every_kernel_case_and_writes_its_table(tmp_path):
    out = tmp_path / "plan.json"
    proc = run_in_process(["-m", "scripts.bench_plan"], "--lengths=1024", "--repeats=1", f"--json={out}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    cases = default_variants()[0]
    rows = [line.split("|")[1].strip() for line in proc.stdout.splitlines() if line.startswith("| ")][1:]
    assert rows == cases, rows  # every case, in the GPU benchmark's order, once
    results = json.loads(out.read_text())["results"]
    assert [r["variant"] for r in results] == cases and {r["n"] for r in results} == {1024}
    by_case = {r["variant"]: r for r in results}
    assert by_case["swa"]["kernels"] == "span"  # the CUDA path's plans, simulated on the CPU
    assert by_case["swa:attn_backend=flex"]["kernels"] == "flex"
    assert by_case["swa"]["scan_ms"] is not None and by_case["full"]["scan_ms"] is None
    assert all(r["plan_ms"] >= 0 and r["scores_ms"] >= 0 for r in results)


def test_rows_over_the_budget_are_marked():
    bench_plan = load_script("bench_plan")
    row = {"variant": "mswa", "n": 32768, "kernels": "span", "plan_ms": 60.0, "edges_ms": 2.0, "scores_ms": 51.0,
           "scan_ms": 400.0}  # the scan is a comparison, not held to the budget
    row["over_budget"] = bench_plan.over_budget(row, 50.0)
    assert row["over_budget"] == ["plan", "scores"]
    fast = {**row, "variant": "swa", "plan_ms": 1.0, "scores_ms": 1.0, "edges_ms": None}
    fast["over_budget"] = bench_plan.over_budget(fast, 50.0)
    header, _, slow_row, fast_row = ([cell.strip() for cell in line.split("|")[1:-1]]
                                     for line in bench_plan.table([row, fast], 50.0).splitlines())
    assert header[-1] == "over 50 ms" and slow_row[-1] == "**plan, scores**"
    assert fast_row[4] == "-" and fast_row[-1] == ""  # no edge counts: "-"; within the budget: no mark
