"""scripts/gpu_check.py on CPU (--quick): the one-command GPU check must run end to end here, so that it cannot rot
before a GPU runs it; a failing step is recorded and the next one still runs. Its decisions (which tests it runs,
which kernels a GPU must have and use, how long it may take) are checked here without a GPU."""

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attention.layer import MaskedAttention
from attention.registry import MIXERS
from conftest import REPO, run_in_process
from scripts.gpucheck import (backends, budgets, context, environment, gpu_tests, memory, options, processes, report,
                              resume, tools, training)



def step_context(out: Path, device: str, cfg=None, budget_s: float = 60, explicit: bool = False):
    """A StepContext as the check hands it to a step: reduced sizes on the CPU, full on CUDA."""
    reduced = "reduced" if device == "cpu" else ""
    return context.StepContext(cfg=cfg or options.CheckConfig(), device=device, out=out, reduced=reduced,
                               sizes=options.REDUCED if reduced else options.FULL, budget_s=budget_s,
                               started=time.time(), publish=None, explicit=explicit)


def gpu_check(out, *args) -> subprocess.CompletedProcess:
    """python -m scripts.gpu_check --device=cpu --quick, in this process (its steps start their own processes)."""
    return run_in_process(["-m", "scripts.gpu_check"], "--device=cpu", "--quick", f"--out={out}", *args)


# two runs of the grid, the riskiest (their mixers' GPU kernels, on the CPU their built-in forms), and a run only a GPU
# makes (recorded as not applicable here): the other runs train every registry case through the same step, which
# the simulated CUDA path trains compiled (tests/models/test_gpu_sim.py) and the grid's cover is asserted below
QUICK_RUNS = ("swax", "swax_gdn", "swax_fp16")


@pytest.mark.e2e
def test_quick_cpu_check_runs_every_step_and_writes_the_report(tmp_path):
    # every step but gpu_tests, which would run this suite's GPU tests inside the suite (the suite runs them
    # itself; the step's logic is checked below with a stand-in for its pytest run), compile_check, minutes
    # on 2 cores (skipped unless named: below), and resume, which the same command runs end to end on the
    # simulated CUDA path (tests/models/test_gpu_sim.py: its results asserted there)
    chosen = [name for name in options.STEPS if name not in ("gpu_tests", "compile_check", "resume")]
    proc = gpu_check(tmp_path, f"--steps={','.join(chosen)}", f"--runs={','.join(QUICK_RUNS)}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = json.loads((tmp_path / "report.json").read_text())
    recorded = written["steps"]
    assert list(recorded) == chosen
    # one process cannot be two GPUs
    assert recorded["multi_gpu"]["status"] == "skipped" and "two or more GPUs" in recorded["multi_gpu"]["summary"]
    for name in set(chosen) - {"multi_gpu"}:
        assert recorded[name]["status"] == "passed", (name, recorded[name]["summary"], recorded[name]["error"])
        assert recorded[name]["reduced"] == "reduced (CPU, --quick)"  # every number is labelled as not the hardware's
    compared = recorded["backends"]["results"]
    assert len(compared["cases"]) == compared["expected_cases"] > 30
    assert {c["family"] for c in compared["cases"]} >= {"swa", "mswa", "sa", "swat", "pbb", "se_bridge_union"}
    assert all(c["passed"] for c in compared["cases"])
    runs = {r["mixer"]: r for r in recorded["train_runs"]["results"]["runs"]}
    window = options.REDUCED["train_runs"]["window"]
    assert set(runs) == set(QUICK_RUNS)
    trained = [r for r in runs.values() if r["status"] == "passed"]
    assert {r["mixer"] for r in trained} == set(QUICK_RUNS) - set(options.cuda_only_runs(window))
    assert runs["swax_fp16"]["status"] == "not applicable"
    assert all(r["val_loss_end"] < r["val_loss_start"] for r in trained)
    # without --runs the step trains the whole grid: every registered mixer
    assert options.grid_runs(options.REDUCED["train_runs"]) == list(options.train_runs(window))
    assert set(options.train_runs(window)) >= set(MIXERS) | set(QUICK_RUNS)
    assert recorded["memory"]["results"]["estimated_gib"] > 0 and recorded["memory"]["results"]["measured_gib"] is None
    markdown = (tmp_path / "report.md").read_text()
    assert "reduced (CPU, --quick)" in markdown and "| train_runs | **passed** |" in markdown
    assert written["device"] == "cpu" and written["git_hash"]


@pytest.mark.parametrize("explicit, status", [(False, "skipped"), (True, "failed")])
def test_compile_check_on_cpu_in_quick_mode_runs_only_when_named(tmp_path, monkeypatch, explicit, status):
    def fake_run(command, log_name, **_):  # compile_check.py exiting without its results
        return processes.Completed(command, 1, 1.0, "log", "", None)

    ctx = step_context(tmp_path, "cpu", options.CheckConfig(quick=True), explicit=explicit)
    monkeypatch.setattr(ctx, "run", fake_run)
    assert tools.step_compile_check(ctx)["status"] == status


@pytest.mark.parametrize("killed_steps, resumed_says, expected", [
    ("all", "", "nothing to resume"),  # the kill came after the run had finished
    (2, "already finished at step {end}", "did not resume"),  # a resume that trained nothing
    (2, "resumed from {out}/ckpt_last.pt at step {at} (best val loss 1.0)", "passed")])
def test_the_resume_check_passes_only_when_a_run_resumed(tmp_path, monkeypatch, killed_steps, resumed_says, expected):
    at, end = options.REDUCED["resume"]["checkpoint_at"], options.REDUCED["resume"]["max_iters"]

    def log(out, steps):
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train_loss": 1 / s}) + "\n" for s in steps))

    def fake_run(command, log_name, kill_when=None):
        out = Path(next(a for a in command if a.startswith("--out_dir=")).split("=", 1)[1])
        said = ""
        if log_name == "resume_unbroken":
            log(out, range(1, end + 1))
        elif log_name == "resume_killed":  # killed_steps: all of them, or 2 past the checkpoint
            log(out, range(1, (end if killed_steps == "all" else at + killed_steps) + 1))
        elif resumed_says.startswith("resumed"):  # what train.py does: the log cut at the checkpoint, then on
            log(out, range(1, end + 1))
            said = resumed_says.format(out=out, at=at)
        else:
            said = resumed_says.format(end=end)
        (tmp_path / f"{log_name}.log").write_text(said + "\n")
        return processes.Completed(command, -9 if log_name == "resume_killed" else 0, 1.0, "log", said,
                               tmp_path / f"{log_name}.log")

    monkeypatch.setattr(resume, "train_base", lambda *_: ["configs/quickstart.py"])
    ctx = step_context(tmp_path, "cpu")
    monkeypatch.setattr(ctx, "run", fake_run)
    result = resume.step_resume(ctx)
    assert (result["status"] == "passed") == (expected == "passed")
    assert expected == "passed" or expected in result["summary"], result


@pytest.mark.e2e
def test_a_failing_step_is_recorded_and_the_next_one_still_runs(tmp_path):
    # the first step fails (injected) and is rerun; the next one, multi_gpu, records why it skips on the CPU: steps
    # that start no training (every step runs in the quick check above, the failure path is the runner's alone)
    proc = gpu_check(tmp_path, "--steps=preflight,multi_gpu", "--fail_steps=preflight")
    assert proc.returncode == 1
    recorded = json.loads((tmp_path / "report.json").read_text())["steps"]
    assert recorded["preflight"]["status"] == "failed" and "injected failure" in recorded["preflight"]["summary"]
    assert "Traceback" in recorded["preflight"]["error"]
    assert recorded["multi_gpu"]["status"] == "skipped" and "two or more GPUs" in recorded["multi_gpu"]["summary"]
    assert f"## {options.STEPS.index('preflight') + 1}. preflight: failed" in (tmp_path / "report.md").read_text()
    # --only reruns the failed step into the same report and keeps the others' results
    proc = gpu_check(tmp_path, "--only=preflight")
    assert proc.returncode == 0, proc.stdout[-3000:]
    written = json.loads((tmp_path / "report.json").read_text())
    assert [written["steps"][s]["status"] for s in ("preflight", "multi_gpu")] == ["passed", "skipped"]
    assert len(written["runs"]) == 2


@pytest.mark.e2e
def test_the_check_writes_only_into_a_folder_of_its_own(tmp_path):
    """Its steps remove and remake their run folders inside --out: a folder with anything else in it (a run, a
    user's files) is refused before anything runs, and nothing in it is touched."""
    from scripts.gpucheck.runner import OUTPUT_MARKER, output_folder_problem

    (tmp_path / "runs" / "swa").mkdir(parents=True)
    (tmp_path / "runs" / "swa" / "ckpt_best.pt").write_bytes(b"a user's checkpoint")
    assert "did not write" in output_folder_problem(tmp_path)
    proc = run_in_process(["-m", "scripts.gpu_check"], f"--out={tmp_path}", "--device=cpu", "--quick",
                          "--steps=train_runs", "--runs=swa")
    assert proc.returncode == 2 and "did not write" in proc.stderr, proc.stderr
    assert [p.name for p in tmp_path.rglob("*")] == ["runs", "swa", "ckpt_best.pt"]
    assert output_folder_problem(tmp_path / "new") == "" and output_folder_problem(tmp_path / "runs" / "swa" / "x") == ""
    (tmp_path / OUTPUT_MARKER).touch()  # an earlier check's folder
    assert output_folder_problem(tmp_path) == ""
    (tmp_path / "afile").write_text("x")
    assert "is a file" in output_folder_problem(tmp_path / "afile")


@pytest.mark.parametrize("args, message", [(["--steps=backend"], "unknown step"),
                                           (["--device=cuda"], "CUDA is not available"),
                                           (["--budget_scale=0"], "budget_scale"),
                                           (["--steps=memory", "--only=resume"], "not both")])
@pytest.mark.e2e
def test_bad_options_exit_with_status_2(tmp_path, monkeypatch, args, message):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no GPU, even on a GPU machine
    proc = run_in_process(["-m", "scripts.gpu_check"], f"--out={tmp_path}", *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "report.json").exists()


@pytest.fixture(scope="session")
def gpu_test_ids(tmp_path_factory):
    """budgets.collected_gpu_tests(), the collection the check runs (pytest --collect-only over gpu_tests.GPU_TESTS),
    once per session: the xdist workers share it through a file in the folder they share. Its pytest runs in this
    process (run_in_process): what is checked is what it collects, and a fresh interpreter importing torch and
    the test modules would cost half a minute."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's folder, above each worker's own
    path = shared / "gpu_test_ids.json"
    real_run = subprocess.run

    def pytest_here(command, *args, **kwargs):
        if list(command[:3]) != [sys.executable, "-m", "pytest"] or kwargs.get("cwd") != REPO:
            return real_run(command, *args, **kwargs)
        return run_in_process(list(command[1:]))

    with FileLock(f"{path}.lock"):
        if not path.exists():
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(subprocess, "run", pytest_here)
                path.write_text(json.dumps(budgets.collected_gpu_tests.__wrapped__()))
        ids = json.loads(path.read_text())
    return None if ids is None else tuple(ids)


@pytest.mark.e2e
def test_plan_fits_20_minutes_on_one_h100_with_budgets_from_counted_compilations(tmp_path, monkeypatch, gpu_test_ids):
    # in this process, its budgets from the session's one collection of the gpu tests (budgets caches it per process)
    monkeypatch.setattr(budgets, "collected_gpu_tests", lambda: gpu_test_ids)
    proc = run_in_process(["-m", "scripts.gpu_check"], "--plan", f"--out={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    total = next(line for line in proc.stdout.splitlines() if line.startswith("total"))
    assert float(total.split()[1]) <= 20 * 60 == options.TOTAL_LIMIT_S
    names = budgets.default_steps()
    # each step's budget counts what the steps before it in the same command leave in the caches
    assert sum(budgets.step_budget(name, False, after=names[:i]) for i, name in enumerate(names)) \
        <= options.TOTAL_LIMIT_S
    assert budgets.step_budget("resume", False, after=["train_runs"]) < budgets.step_budget("resume", False)
    # riskiest first: the default check is a prefix of STEPS but for steps too long for what is left
    assert names[:6] == list(options.STEPS[:6])
    for name in options.STEPS:  # every budget is its counted compilations' estimate with the margin
        estimate = budgets.step_estimate(name)
        assert budgets.step_budget(name, False) == pytest.approx(options.MARGIN * estimate.seconds)
        compile_s = sum(options.COMPILE_S[kind] * count for kind, count in estimate.compiles)
        assert estimate.seconds >= compile_s / max(1, estimate.jobs)
    for name in names:  # listed with its budget and its compilations
        assert any(line.startswith(name + " ") and " s   " in line for line in proc.stdout.splitlines()), name
    assert "60 s per flex" in proc.stdout  # each per-compile estimate is stated
    # a full-size step that compiles flex kernels counts them: its grid's, each distinct one once
    assert dict(budgets.step_estimate("gpu_tests").compiles)["flex"] >= 10
    train = dict(budgets.step_estimate("train_runs").compiles)
    # the windowed runs' attention: span attention's Triton kernels on CUDA (FlexAttention for other rules)
    assert train["span"] >= 1 and train["graph"] > train["span"] and train["cached"] > 0
    # what does not fit is printed with the commands that run it
    rest = [name for name in options.STEPS if name not in names]
    assert rest and all(name in proc.stdout.split("left to a second command")[1] for name in rest)
    parts = budgets.plan_parts(names)
    assert [name for part in parts for name in part] == names
    assert all(sum(budgets.step_budget(name, False, after=part[:i]) for i, name in enumerate(part))
               <= options.CALL_LIMIT_S < 600 for part in parts)
    # the training runs left out of the grid, in commands that fit a call each by their own counted budgets
    left_out = budgets.step_estimate("train_runs").left_out
    for command in left_out.partition(": ")[2].split("; "):
        runs = command.partition("--runs=")[2]
        assert budgets.step_budget("train_runs", False, runs=runs) <= options.CALL_LIMIT_S, command
    assert not (tmp_path / "report.json").exists()  # nothing ran


def test_the_memory_step_sizes_its_model_so_the_ratio_not_an_out_of_memory_decides():
    # the 1.4B recipe's 24 layers plan ~66 GiB on an 80 GB GPU: layers come off by pattern periods until a peak
    # of MEMORY_HEADROOM x the plan (above the accepted ratio) still fits
    per_layer, weights = 2.5, 0.5
    needed = lambda n: weights * n + options.MEMORY_HEADROOM * per_layer * n  # noqa: E731
    free = 0.9 * 79
    layers = memory.memory_layers(24, 2, free, needed)
    assert layers % 2 == 0 and needed(layers) <= free < needed(layers + 2)
    assert options.MEMORY_HEADROOM > options.MEMORY_RATIO[1]
    assert memory.memory_layers(2, 2, 1.0, needed) == 2  # one period at least: the plan's check then fails loudly


def test_an_out_of_memory_error_in_the_memory_step_is_a_ratio_beyond_bounds(tmp_path, monkeypatch):
    measured = {"config": "c.py", "n_layer": 18, "recipe_n_layer": 24, "n_embd": 2048, "tokens": 16384,
                "attn_pattern": "swax", "dtype": "bfloat16", "estimated_gib": 44.7, "peak_moment": "backward",
                "measured_gib": None, "ratio": None, "out_of_memory": True, "more_than_gib": 62.0}

    def out_of_memory(command, log_name, timeout=None, env=None, kill_when=None):
        (tmp_path / "memory.json").write_text(json.dumps(measured))
        return processes.Completed(command, 0, 30.0, "log", "", None)

    ctx = step_context(tmp_path, "cuda", budget_s=150)
    monkeypatch.setattr(ctx, "run", out_of_memory)
    result = memory.step_memory(ctx)
    assert result["status"] == "failed" and "measured / planned > 1.39" in result["summary"]
    assert "out of memory above 62.0 GiB" in "\n".join(report.render_memory(result["results"]))


def test_riskiest_steps_and_runs_come_first():
    assert options.STEPS[:3] == ("preflight", "gpu_tests", "train_runs")
    assert list(options.train_runs(64))[:3] == ["swax", "swax_gdn", "swax_fsdp"]  # the Triton mLSTM, fla, FSDP


@pytest.mark.e2e
def test_gpu_tests_are_selected_by_marker_never_by_name(gpu_test_ids):
    # `-k cuda` ignored case and picked this file's "CUDA is not available" case, a whole GPU check inside the
    # check; the marker selects exactly the tests of GPU paths. gpu_test_ids: None when pytest failed or selected
    # nothing
    selected = gpu_test_ids
    assert selected is not None and len(selected) >= 25, selected
    assert not [t for t in selected if "test_gpu_check.py" in t or "gpu_check" in t.partition("::")[2]]
    assert {t.partition("::")[0] for t in selected} >= {"tests/ops/test_attention.py", "tests/layers/test_sa.py",
                                                        "tests/layers/test_swat.py", "tests/layers/test_bridge.py",
                                                        "tests/layers/test_mlstm.py", "tests/ops/test_span_kernel.py"}


@pytest.mark.e2e
def test_a_timeout_kills_every_process_the_command_started(tmp_path):
    # the child starts a grandchild in a session of its own (as the nested pytest did), out of the child's
    # process group: the timeout must still end it
    script = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
              "time.sleep(120)'], start_new_session=True); print(p.pid, flush=True); time.sleep(120)")
    done = processes.run_command([sys.executable, "-c", script], tmp_path / "log.txt", timeout=3)
    assert done.timed_out
    grandchild = int(done.output().splitlines()[1])
    deadline = time.time() + 10
    while time.time() < deadline and os.path.exists(f"/proc/{grandchild}") and \
            open(f"/proc/{grandchild}/stat").read().rpartition(")")[2].split()[0] != "Z":
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{grandchild}") or \
        open(f"/proc/{grandchild}/stat").read().rpartition(")")[2].split()[0] == "Z"  # dead (a zombie at most)


def cuda_environment(**changes):
    env = {"torch": "2.13.0", "triton_pin": "3.7.1", "triton_block_ptr": True,
           "optional_kernels": {"triton": "3.7.1", "mlstm_kernels": "2.0.6", "flash-linear-attention": "0.6.0"}}
    for key, value in changes.items():
        (env["optional_kernels"] if key in env["optional_kernels"] else env)[key] = value
    return env


def test_a_missing_gpu_kernel_fails_on_cuda_with_its_fix():
    assert environment.gpu_kernel_problems("cuda", cuda_environment()) == []
    assert environment.gpu_kernel_problems("cpu", cuda_environment(mlstm_kernels="not installed")) == []
    problems = environment.gpu_kernel_problems("cuda", cuda_environment(mlstm_kernels="not installed"))
    assert problems == ["mlstm_kernels is not installed: pip install -r requirements-gpu.txt"]
    assert "flash-linear-attention" in environment.gpu_kernel_problems(
        "cuda", cuda_environment(**{"flash-linear-attention": "not installed"}))[0]
    # a Triton without tl.make_block_ptr (3.9 removed it): the fix names torch's pin
    [problem] = environment.gpu_kernel_problems("cuda", cuda_environment(triton="3.9.0", triton_block_ptr=False))
    assert "Triton 3.9.0 has no tl.make_block_ptr" in problem and "pip install triton==3.7.1" in problem
    # Triton 3.4.0-3.7.0 on Hopper (torch 2.11's 3.6.0 on an H200, as a GPU run met it): fla refuses its gated
    # backward there; other GPUs and Triton 3.7.1 pass
    hopper = {"capability": [9, 0], "device_name": "NVIDIA H200"}
    [problem] = environment.gpu_kernel_problems("cuda", cuda_environment(triton="3.6.0", **hopper))
    assert "Triton 3.6.0 on a Hopper GPU (NVIDIA H200)" in problem and "torch==2.13.0" in problem
    assert environment.gpu_kernel_problems("cuda", cuda_environment(triton="3.6.0", capability=[8, 0])) == []
    assert environment.gpu_kernel_problems("cuda", cuda_environment(triton="3.7.1", **hopper)) == []
    assert environment.gpu_kernel_problems("cuda", cuda_environment(triton="3.3.1+git9c1d", **hopper)) == []


def test_the_kernel_tests_must_pass_on_cuda():
    passed = [{"test": f"tests/layers/test_mlstm.py::{gpu_tests.REQUIRED_GPU_TESTS[k]}", "outcome": "passed"}
              for k in gpu_tests.REQUIRED_GPU_TESTS]
    assert gpu_tests.missing_kernel_tests("cuda", passed) == []
    missing = gpu_tests.missing_kernel_tests("cuda", passed[:1])
    assert len(missing) == 1 and missing[0].startswith("fla's Gated DeltaNet kernel")
    assert gpu_tests.missing_kernel_tests("cpu", []) == []


def test_the_required_kernel_tests_are_gpu_tests_of_the_suite():
    # a renamed test would leave the check waiting for one that never runs
    for name in gpu_tests.REQUIRED_GPU_TESTS.values():
        found = [node for path in (REPO / "tests").rglob("test_*.py") for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.FunctionDef) and node.name == name]
        assert len(found) == 1, name
        assert any(ast.unparse(d) == "pytest.mark.gpu" for d in found[0].decorator_list), name


def test_a_gpu_tests_step_cut_off_by_its_budget_reports_what_finished_and_what_did_not(tmp_path, monkeypatch):
    # results are recorded per test as they finish (tests/conftest.py: --results-log): a timeout keeps them, and
    # a kernel test that was collected but never ran is said to be unfinished, not uninstalled
    triton = f"tests/layers/test_mlstm.py::{gpu_tests.REQUIRED_GPU_TESTS[next(iter(gpu_tests.REQUIRED_GPU_TESTS))]}"
    collected = ["tests/ops/test_attention.py::a", "tests/ops/test_attention.py::b", triton]

    def cut_off(command, log_name, timeout=None, env=None, kill_when=None):
        log = Path(next(a for a in command if a.startswith("--results-log=")).partition("=")[2])
        log.write_text(json.dumps({"collected": collected}) + "\n"
                       + json.dumps({"test": collected[0], "outcome": "passed", "seconds": 1.0, "message": ""}) + "\n"
                       + json.dumps({"test": collected[1], "outcome": "failed", "seconds": 1.0, "message": "boom"})
                       + "\n" + '{"test": "tests/ops/test_attention.py::c", "outc')  # a line torn by the kill
        return processes.Completed(command, None, 150.0, "log", "", None)

    ctx = step_context(tmp_path, "cuda", budget_s=150)
    monkeypatch.setattr(ctx, "run", cut_off)
    result = gpu_tests.step_gpu_tests(ctx)
    assert result["status"] == "failed"
    assert result["summary"].startswith("timed out after 150 s: 1 failed, 1 passed; 1 of 3 did not finish")
    assert result["results"]["unfinished"] == [triton]
    assert "did not finish before the step was cut off" in result["error"] and "not installed" in result["error"]
    markdown = "\n".join(report.render_gpu_tests(result["results"]))
    assert "Did not finish (1 of 3 collected)" in markdown and "boom" in markdown


@pytest.mark.e2e
def test_the_results_log_records_each_test_as_it_finishes(tmp_path):
    log = tmp_path / "results.jsonl"
    # a file of quick tests (the import checks): the log is what is checked, not the tests
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           "tests/runs/test_layers.py", f"--results-log={log}"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:]
    collected, tests = gpu_tests.read_results_log(log)
    assert len(collected) == len(tests) >= 5 and {t["outcome"] for t in tests} == {"passed"}
    assert {t["test"] for t in tests} == set(collected)


def test_recurrent_runs_name_their_gpu_kernel_on_cuda_and_must_show_it_in_use():
    # on CUDA's path (a GPU, or the CPU standing in for one) every GPU kernel is demanded
    assert "--mlstm_kernel=triton" in training.run_options("swax", True, 64)
    assert "--gdn_kernel=fla" in training.run_options("swax_gdn", True, 64)
    assert not [o for o in training.run_options("swax", False, 64) if "kernel" in o]
    assert not [o for o in training.run_options("swa", True, 64) if "kernel" in o]
    swax_options = training.run_options("swax", True, 64)
    used = "  layers 1, 3: mLSTM: 8 heads, q/k 32 and v 64 per head, chunk 64, kernel triton (mlstm_kernels, ...)"
    assert training.kernel_use_problem(swax_options, "model: ...\n" + used) == ""
    fallback = used.replace("kernel triton (mlstm_kernels, ...)", "kernel native")
    assert "no mlstm layer reports 'kernel triton'" in training.kernel_use_problem(swax_options, fallback)


def test_the_checks_cover_every_registered_mixer():
    # no list of variants in the check: its runs and backend families come from the registry's cases
    window = options.REDUCED["train_runs"]["window"]
    assert set(MIXERS) <= set(options.train_runs(window))
    attention = {name for name, cls in MIXERS.items() if issubclass(cls, MaskedAttention)}
    assert attention <= set(backends.backend_families())
    assert {kernel[2] for kernel in options.gpu_kernel_mixers().values()} == {"mlstm_kernels", "flash-linear-attention"}


def test_reduced_budgets_grow_with_the_load_other_processes_put_on_the_cores():
    # quiet cores: the measured budgets; two busy processes on two cores: each step gets half of them
    assert budgets.shared_cores_scale(0.0, 2) == 1.0
    assert budgets.shared_cores_scale(2.0, 2) == 2.0
    assert budgets.shared_cores_scale(4.0, 2) == 3.0
    assert budgets.shared_cores_scale(3.0, 16) == pytest.approx(1.1875)
