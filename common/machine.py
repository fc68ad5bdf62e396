"""What the machine a job runs on is doing, when it matters for the numbers: other processes holding the cores.

The CPU kernels run many small ops, and with several OpenMP threads each op ends at a barrier where the threads
wait for each other. By default they wait spinning: on a quiet machine that is the fastest, but when another
process holds a core, a spinning thread of ours burns the time slice its partner needs and every barrier
stalls (on a shared 2-core machine the quick start ran 4-10x slower). passive_openmp() makes them wait asleep
instead, before torch starts OpenMP: 13% slower on a quiet machine, 2.3x faster beside a busy process
(docs/benchmarks.md, scripts/bench_busy_cpu.py). OMP_WAIT_POLICY or GOMP_SPINCOUNT set by the user win
(GOMP_SPINCOUNT=300000 is OpenMP's default spinning); OMP_NUM_THREADS sets the thread count.
"""

import os
import sys

_OWN_CHOICE = []  # whether passive_openmp set the policy, and before torch was imported


def passive_openmp() -> None:
    """Make OpenMP's threads wait asleep unless the user chose otherwise. Call before importing torch: OpenMP
    reads its environment once, when torch loads it."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        _OWN_CHOICE.append("torch" not in sys.modules)


def openmp_note() -> str:
    """One line for the log: torch's CPU threads and how they wait, and how to change it."""
    import torch

    threads = torch.get_num_threads()
    if _OWN_CHOICE and _OWN_CHOICE[0]:
        how = ("waiting asleep at barriers (OMP_WAIT_POLICY=PASSIVE: robust beside busy processes; "
               "GOMP_SPINCOUNT=300000 spins instead, 13% faster on a quiet machine)")
    elif os.environ.get("OMP_WAIT_POLICY") or os.environ.get("GOMP_SPINCOUNT"):
        how = ", ".join(f"{k}={os.environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ)
    else:  # torch was loaded before the policy could be set
        how = "OpenMP's default spinning wait"
    return f"cpu: {threads} torch thread{'s' if threads != 1 else ''}" + (f", {how}" if threads > 1 else "") + \
        ("" if "OMP_NUM_THREADS" in os.environ else "; OMP_NUM_THREADS=N sets the count")


def busy_note(threads: int) -> str:
    """A line when the load average says other processes hold cores that `threads` torch threads need ("" when
    the machine is free enough, or the load cannot be read)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return ""
    cores = os.cpu_count() or 1
    if threads <= 1 or load + threads <= cores + 0.5:
        return ""
    return (f"note: the machine is busy (load {load:.1f} on {cores} cores) and torch runs {threads} threads: their "
            "barriers stall behind the other processes; for timings, run with OMP_NUM_THREADS=1 or on an idle "
            "machine")
