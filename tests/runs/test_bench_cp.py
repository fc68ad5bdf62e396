"""scripts/bench_cp.py: the bytes its table prints are the exchanges' own counts, equal to their plans and the same at
two lengths, and the activation memory per process falls with the shards."""

import json
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.e2e
def test_the_benchmark_counts_the_halo_and_the_summaries_at_two_lengths(tmp_path):
    out = tmp_path / "cp.json"
    proc = subprocess.run([sys.executable, "-m", "scripts.bench_cp", "--cases=swa,linear", "--P=2",
                           "--lengths=128,256", "--window=32", "--heads=2", "--head_dim=16", f"--json={out}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = {(r["case"], r["n"]): r for r in result["table"]}
    assert set(rows) == {("swa", 128), ("swa", 256), ("linear", 128), ("linear", 256)}
    assert all(r["kv_counted_as_planned"] and r["n_independent"] for r in rows.values())
    # a window of 32: its 31 keys and values per layer (2 heads of 16, float32), whatever the length
    assert rows[("swa", 256)]["kv_forward_bytes"] == 31 * 2 * 2 * 16 * 4
    assert rows[("linear", 256)]["state_forward_bytes"] > 0 == rows[("linear", 256)]["kv_forward_bytes"]
    assert rows[("swa", 256)]["activation_bytes"] < 0.7 * rows[("swa", 256)]["whole_activation_bytes"]
    projected = result["projected"]["swa"]
    assert projected["kv_bytes"] == 31 * 2 * 16 * 64 * 2 and projected["all_gather_bytes"] > 1000 * projected["kv_bytes"]
    assert "projected to n=131,072 over P=8" in proc.stdout
