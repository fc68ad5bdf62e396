"""The gpu_tests step: the suite's tests marked gpu, each test's outcome read from the log pytest writes as it goes,
and the GPU kernels whose tests must pass on CUDA."""

import json
import shlex
from pathlib import Path

from scripts.gpucheck.context import StepContext, outcome

GPU_TESTS = ["-m", "gpu", "tests/"]  # the tests marked gpu (tests/conftest.py), by marker: never by name
# on CUDA these must be among the tests that passed: they are defined only where their kernel is installed
REQUIRED_GPU_TESTS = {
    "mlstm_kernels' Triton kernel": "test_cuda_triton_kernel_equals_native_chunkwise_and_mlstm_kernels_backward",
    "fla's Gated DeltaNet kernel": "test_cuda_fla_layer_equals_native_layer_in_bf16"}


def missing_kernel_tests(device: str, tests: list[dict], collected: list[str] | None = None) -> list[str]:
    """The GPU kernels whose tests did not pass in a gpu_tests run on CUDA (none off CUDA), each with why: not
    collected (the package is not installed), collected but unfinished (the step was cut off), or failed."""
    if device != "cuda":
        return []
    outcomes = {t["test"].rpartition("::")[2].partition("[")[0]: t["outcome"] for t in tests}
    names = {test.rpartition("::")[2].partition("[")[0] for test in (collected or [])}
    missing = []
    for kernel, name in REQUIRED_GPU_TESTS.items():
        if outcomes.get(name) == "passed":
            continue
        if name in outcomes:
            why = f"{name} {outcomes[name]}"
        elif name in names:
            why = f"{name} did not finish before the step was cut off"
        else:
            why = f"{name} did not pass (not installed, or it failed)"
        missing.append(f"{kernel}: {why}")
    return missing


def read_results_log(path: Path) -> tuple[list[str], list[dict]]:
    """tests/conftest.py's --results-log: (the collected test ids, each finished test's last record); a line torn
    by a kill is skipped."""
    collected, tests = [], {}
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "collected" in record:
            collected = record["collected"]
        elif record.get("outcome") != "passed" or record["test"] not in tests:  # a teardown error stays an error
            tests[record["test"]] = record
    return collected, list(tests.values())


def step_gpu_tests(ctx: StepContext) -> dict:
    """The tests marked gpu in ctx.jobs pytest workers, each test's outcome recorded as it finishes (so a step cut
    off by its budget reports what finished and what did not). On an H100 each test of a flex backend compiles
    its rule's FlexAttention kernels, and the Triton and fla kernel tests autotune their packages (step_estimate
    counts them). On CPU they run under the device guard of tests/conftest.py (flex forward only)."""
    log = ctx.out / "gpu_tests.jsonl"
    log.unlink(missing_ok=True)
    workers = ["-n", str(ctx.jobs)] if ctx.device == "cuda" and ctx.jobs > 1 else []
    done = ctx.run([ctx.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers, *GPU_TESTS,
                    f"--results-log={log}"], "gpu_tests")
    collected, tests = read_results_log(log)
    counts = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    unfinished = [test for test in collected if test not in {t["test"] for t in tests}]
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no tests ran"
    if unfinished:
        summary += f"; {len(unfinished)} of {len(collected)} did not finish"
    if done.timed_out:
        summary = f"timed out after {done.seconds:.0f} s: " + summary
    if ctx.device != "cuda":
        summary += " (on the CPU, under the device guard" + \
            ("; simulated CUDA: flex forward and backward)" if ctx.gpu_path else ")")
    results = {"counts": counts, "tests": tests, "collected": len(collected), "unfinished": unfinished,
               "command": shlex.join(done.command)}
    missing = missing_kernel_tests(ctx.device, tests, collected)
    if done.timed_out or done.returncode != 0 or not tests or missing or unfinished:
        # pytest exits 5 when it collects nothing: the GPU tests are missing, a failure too
        failure = [done.error()] if done.timed_out or done.returncode else []
        not_run = [f"did not finish: {', '.join(unfinished[:20])}" + (" ..." if len(unfinished) > 20 else "")] \
            if unfinished else []
        return outcome("failed", summary, results, "\n".join(missing + not_run + failure))
    return outcome("passed", summary, results)
