"""Running the GPU check: its steps in order, each within its budget, the report rewritten as each one goes;
a failing step is recorded and the next one still runs."""

import json
import os
import shlex
import signal
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

from attention import simulate_cuda
from common.outputs import claim_own_folder, own_folder_problem
from scripts.gpucheck.backends import step_backends
from scripts.gpucheck.budgets import default_steps, shared_cores_scale, step_budget
from scripts.gpucheck.context import StepContext
from scripts.gpucheck.environment import environment
from scripts.gpucheck.gpu_tests import step_gpu_tests
from scripts.gpucheck.memory import step_memory
from scripts.gpucheck.multi_gpu import step_multi_gpu
from scripts.gpucheck.options import FULL, REDUCED, STEPS, CheckConfig
from scripts.gpucheck.preflight import step_preflight
from scripts.gpucheck.pretrained import step_pretrained
from scripts.gpucheck.processes import now, stop_children, tail
from scripts.gpucheck.report import write_report
from scripts.gpucheck.resume import step_resume
from scripts.gpucheck.tools import step_bench_attention, step_bench_train, step_compile_check, step_generate
from scripts.gpucheck.training import step_train_runs

STEP_FUNCTIONS = {"preflight": step_preflight, "gpu_tests": step_gpu_tests, "train_runs": step_train_runs,
                  "resume": step_resume, "memory": step_memory, "pretrained": step_pretrained,
                  "multi_gpu": step_multi_gpu, "backends": step_backends, "bench_attention": step_bench_attention,
                  "bench_train": step_bench_train, "compile_check": step_compile_check, "generate": step_generate}
assert tuple(STEP_FUNCTIONS) == STEPS


OUTPUT_MARKER = ".gpu_check"  # marks a folder as the check's own: its steps empty their run folders inside it


def output_folder_problem(out: Path) -> str:
    """Why the check may not write into out ("" when it may): each step starts its runs afresh by removing their
    folders inside out, so out must be new, empty, or an earlier check's (its marker file)."""
    return own_folder_problem(out, OUTPUT_MARKER, "the GPU check", "out/gpu_check")


def run_check(cfg: CheckConfig, device: str, argv: list[str]) -> int:
    """Run the chosen steps into cfg.out's report; the exit status: 0, 1 when a step failed, 128 + the signal
    when stopped."""
    reduced = [label for label, on in (("CPU", device == "cpu"), ("--quick", cfg.quick),
                                       ("simulated CUDA", simulate_cuda.simulated(device))) if on]
    reduced = f"reduced ({', '.join(reduced)})" if reduced else ""
    sizes = REDUCED if reduced else FULL
    chosen = cfg.steps or cfg.only
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    # at full size the steps that fit TOTAL_LIMIT_S (--plan names the rest); reduced, every step
    names = [s for s in STEPS if s in chosen.split(",")] if chosen else \
        (list(STEPS) if reduced else default_steps(gpus, cfg.budget_scale))
    failing = set(filter(None, cfg.fail_steps.split(",")))
    out = Path(cfg.out).resolve()  # subprocesses run in the repository
    claim_own_folder(out, OUTPUT_MARKER)

    run = {**environment(device), "command": shlex.join(["python", "-m", "scripts.gpu_check", *argv]),
           "started": now(), "reduced": reduced, "options": asdict(cfg)}
    report = {"runs": [], "steps": {}}
    if cfg.only and (out / "report.json").exists():
        report = json.loads((out / "report.json").read_text())
        for name in names:
            report["steps"].pop(name, None)
        if not report["steps"]:
            report["runs"] = []
    # reduced steps on a CPU whose cores others keep busy: budgets in proportion, measured before any step runs
    shared = shared_cores_scale(os.getloadavg()[0], os.cpu_count() or 1) if reduced and device == "cpu" else 1.0
    run["shared_cores_scale"] = shared
    report["runs"].append(run)
    report.update({k: run[k] for k in ("device", "device_name", "torch", "git_hash", "command")})
    run_index = len(report["runs"]) - 1
    print(f"gpu check: {run['device_name']}; torch {run['torch']}; git {run['git_hash']}; "
          f"{reduced or 'full sizes'}; steps: {', '.join(names)}; report: {out / 'report.md'}", flush=True)
    if shared > 1.05:
        print(f"gpu check: other processes keep the {os.cpu_count()} cores busy (load {os.getloadavg()[0]:.1f}): "
              f"budgets x{shared:.2f}", flush=True)

    stop_signal = []

    def interrupt(signum, frame):  # the running step's subprocesses die, so it ends as failed, and the loop stops
        stop_signal.append(signum)
        signal.signal(signum, signal.SIG_DFL)  # a second signal stops at once
        stop_children()

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)

    for name in names:
        budget = step_budget(name, bool(reduced), run["gpus"], cfg.runs, names[:names.index(name)]) * cfg.budget_scale \
            * shared
        record = {"status": "running", "seconds": 0.0, "budget_s": budget, "reduced": reduced, "run": run_index,
                  "summary": "running (a report showing this was cut off during the step)", "results": None,
                  "error": "", "started": now()}
        report["steps"][name] = record
        write_report(report, out)
        print(f"[{name}] budget {budget:.0f} s ...", flush=True)
        started = time.time()

        def publish(partial, record=record, started=started):
            record["results"], record["seconds"] = partial, time.time() - started
            write_report(report, out)

        ctx = StepContext(cfg, device, out, reduced, sizes, budget, started, publish,
                          explicit=name in chosen.split(","))
        try:
            if name in failing:
                raise RuntimeError(f"injected failure (--fail_steps={cfg.fail_steps})")
            record.update(STEP_FUNCTIONS[name](ctx))
        except Exception as e:  # a broken step is a result: record it, and go on with the next one
            record.update(status="failed", summary=f"{type(e).__name__}: {str(e)[:200]}",
                          error=tail(traceback.format_exc()))
        if stop_signal:
            record.update(status="failed", summary=f"interrupted by signal {stop_signal[0]}: " + record["summary"])
        record["seconds"] = time.time() - started
        record["finished"] = now()
        write_report(report, out)
        print(f"[{name}] {record['status']} in {record['seconds']:.0f} s: {record['summary']}", flush=True)
        if stop_signal:
            break
    failed = [name for name in names if report["steps"].get(name, {}).get("status") == "failed"]
    print(f"report: {out / 'report.md'} and {out / 'report.json'}; "
          + (f"failed: {', '.join(failed)}" if failed else "no step failed"), flush=True)
    if stop_signal:
        return 128 + stop_signal[0]
    return 1 if failed else 0
