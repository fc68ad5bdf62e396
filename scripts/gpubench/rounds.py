"""The driver: every case in a process of its own, in rounds of --jobs cases that warm up at once and then time one
after another; what each case wrote, or why it did not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from attention.ops.span.op import TILES_ENV
from scripts.gpubench.options import BenchConfig, jobs
from scripts.gpubench.timing import GO, safe


def run_jobs(b: BenchConfig, argv: list[str], out: Path, after_round=None) -> dict:
    """Every case in its own process, in rounds of --jobs: a round's cases warm up at once (compiling into the
    caches on disk), and once all are warm (or --ready_by has passed, or --timeout: the late ones are stopped and
    reported) they time one after another. A round ends before the next starts, so only a round's cases hold GPU
    memory at a time (plan_rounds: at most --jobs, and what the GPU's memory allows). What each wrote, or why
    it did not; after_round(results so far, rounds done, rounds) is called after each round, so that a run stopped
    from outside still leaves what its finished rounds measured."""
    started, results = time.time(), {}
    planned = plan_rounds(list(jobs(b)), b, gpu_gib(b.device))
    rounds = len(planned)
    for number, batch in enumerate(planned, 1):
        if time.time() - started > b.timeout:
            for part, name in (case for later in planned[number - 1:] for case in later):
                results[(part, name)] = {"error": f"not started before --timeout={b.timeout} s"}
            break
        print(f"[{time.time() - started:5.0f} s] round {number}/{rounds}: "
              f"{', '.join(f'{part}:{name}' for part, name in batch)}", flush=True)
        for old in (out / "ready").iterdir():  # the last round's marks, GO among them
            old.unlink()
        results.update(run_round(b, argv, out, batch, started))
        if after_round is not None and number < rounds:
            after_round(results, number, rounds)
    print(f"[{time.time() - started:5.0f} s] done", flush=True)
    return results


# what one case holds on the GPU at its peak, in GiB: a training case 9.1 at most at 8K tokens (sa_swa, CUDA graphs'
# pools counted; H100, 2026-11-27), growing with its length; a kernels case at 32K a few; the nanoGPT comparison's
# batch of 16 x 1024 with its optimiser
CASE_GIB = {"kernels": 4.0, "train": 10.0, "nanogpt": 30.0}
MEMORY_SHARE = 0.8  # of the GPU's memory a round's cases may plan to hold (warm-ups peak at different times)


def case_gib(b: BenchConfig, part: str) -> float:
    """CASE_GIB's figure for a case of `part`, grown with its length past the one measured."""
    if part == "train":
        return CASE_GIB[part] * max(1.0, b.train_len / 8192)
    if part == "kernels":
        return CASE_GIB[part] * max(1.0, max(int(n) for n in b.lengths.split(",")) / 32768)
    return CASE_GIB[part]


def gpu_gib(device: str) -> float:
    """The GPU's memory in GiB (0: no limit, the CPU's check of the script)."""
    import torch

    if device != "cuda" or not torch.cuda.is_available():
        return 0.0
    return torch.cuda.get_device_properties(0).total_memory / 2**30


def plan_rounds(cases: list[tuple[str, str]], b: BenchConfig, memory_gib: float) -> list[list[tuple[str, str]]]:
    """The cases in order, in rounds of at most --jobs whose planned memory (CASE_GIB each) fits MEMORY_SHARE of the
    GPU's: twelve training cases at once overflowed an 80 GiB H100, each holding up to 9 GiB."""
    rounds, current, held = [], [], 0.0
    for case in cases:
        need = case_gib(b, case[0])
        if current and (len(current) == b.jobs or (memory_gib and held + need > MEMORY_SHARE * memory_gib)):
            rounds.append(current)
            current, held = [], 0.0
        current.append(case)
        held += need
    return rounds + ([current] if current else [])


def run_round(b: BenchConfig, argv: list[str], out: Path, batch: list[tuple[str, str]], started: float) -> dict:
    procs, round_started = {}, time.time()
    for part, name in batch:
        log = open(out / "logs" / f"{part}_{safe(name)}.log", "w")
        env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               "GPU_BENCH_JOB": f"{part}_{name}"}
        # VARIANT@MxNxWARPSxSTAGES: span attention's tiles for this case, which attention/ops/span/op.py reads when
        # it is imported (as config is, before main runs): set in the case's environment before it starts
        tiles = name.partition("@")[2]
        if tiles:
            env[TILES_ENV] = tiles.replace("x", ",")
        procs[(part, name)] = (subprocess.Popen([sys.executable, "-m", "scripts.gpu_bench", *argv,
                                                 f"--job={part}:{name}"], stdout=log, stderr=subprocess.STDOUT,
                                                env=env), log)
    # warm ones wait for the rest of their round, until --ready_by, and never past --timeout (a round begun late
    # still times the cases that are warm by then)
    deadline = min(round_started + b.ready_by, started + b.timeout)
    while True:
        waiting = [key for key, (proc, _) in procs.items()
                   if proc.poll() is None and not (out / "ready" / safe(f"{key[0]}_{key[1]}")).exists()]
        if not waiting or time.time() > deadline:
            break
        time.sleep(0.5)
    for key in waiting:  # not warm in time: stopped, so that no timing runs beside its warm-up
        procs[key][0].kill()
    (out / "ready" / GO).touch()
    results = {}
    for (part, name), (proc, log) in procs.items():
        try:
            proc.wait(timeout=max(1, b.timeout - (time.time() - started)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        path = out / "results" / f"{part}_{safe(name)}.json"
        if path.exists():
            results[(part, name)] = json.loads(path.read_text())
        elif (part, name) in waiting:
            results[(part, name)] = {"error": f"not warm after --ready_by={b.ready_by} s or by --timeout={b.timeout} "
                                              "s: stopped"}
        else:
            tail = (out / "logs" / f"{part}_{safe(name)}.log").read_text()[-1500:]
            results[(part, name)] = {"error": f"exit {proc.returncode}: {tail}"}
    return results
