"""scripts/gpu_check.py on CPU (--quick): the one-command GPU check must run end to end here, so that it cannot rot
before a GPU runs it; a failing step is recorded and the next one still runs."""

import json
import subprocess
import sys

import pytest

from conftest import REPO

STEPS = ("cuda_tests", "backends", "bench_attention", "bench_train", "train_runs", "compile_check", "generate")


def gpu_check(out, *args, timeout=420) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/gpu_check.py", "--device=cpu", "--quick", f"--out={out}", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_quick_cpu_check_runs_every_step_and_writes_the_report(tmp_path):
    proc = gpu_check(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    steps = report["steps"]
    assert tuple(steps) == STEPS
    # the CUDA tests do not exist on CPU, and compiling every mixer is left to an explicit --steps=compile_check
    assert steps["cuda_tests"]["status"] == "not applicable"
    assert steps["compile_check"]["status"] == "skipped"
    for name in ("backends", "bench_attention", "bench_train", "train_runs", "generate"):
        assert steps[name]["status"] == "passed", (name, steps[name]["summary"], steps[name]["error"])
        assert steps[name]["reduced"] == "reduced (CPU, --quick)"  # every number is labelled as not the hardware's
    backends = steps["backends"]["results"]
    assert len(backends["cases"]) == backends["expected_cases"] > 30
    assert {c["family"] for c in backends["cases"]} >= {"swa", "mswa", "sa", "swat_sigmoid", "pbb_branch",
                                                         "se_bridge_union"}
    assert all(c["passed"] for c in backends["cases"])
    runs = steps["train_runs"]["results"]["runs"]
    assert {r["mixer"] for r in runs} >= {"full", "swa", "sa_swa", "mswa", "pbb", "swax", "swax_gdn", "linear",
                                          "swax_fsdp"}
    assert all(r["val_loss_end"] < r["val_loss_start"] for r in runs)
    markdown = (tmp_path / "report.md").read_text()
    assert "reduced (CPU, --quick)" in markdown and "| train_runs | **passed** |" in markdown
    assert report["device"] == "cpu" and report["git_hash"]


def test_a_failing_step_is_recorded_and_the_next_one_still_runs(tmp_path):
    proc = gpu_check(tmp_path, "--steps=cuda_tests,backends,generate", "--fail_steps=backends")
    assert proc.returncode == 1
    steps = json.loads((tmp_path / "report.json").read_text())["steps"]
    assert steps["backends"]["status"] == "failed" and "injected failure" in steps["backends"]["summary"]
    assert "Traceback" in steps["backends"]["error"]
    assert steps["generate"]["status"] == "passed"
    assert "## 2. backends: failed" in (tmp_path / "report.md").read_text()
    # a later command with --merge=True redoes the failed step and keeps the others' results
    proc = gpu_check(tmp_path, "--steps=backends", "--merge=True")
    assert proc.returncode == 0, proc.stdout[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert [report["steps"][s]["status"] for s in ("cuda_tests", "backends", "generate")] \
        == ["not applicable", "passed", "passed"]
    assert len(report["runs"]) == 2


@pytest.mark.parametrize("args, message", [(["--steps=backend"], "unknown step"),
                                           (["--device=cuda"], "CUDA is not available"),
                                           (["--budget_scale=0"], "budget_scale")])
def test_bad_options_exit_with_status_2(tmp_path, args, message):
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", f"--out={tmp_path}", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "report.json").exists()
