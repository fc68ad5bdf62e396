"""What the machine a job runs on is doing, when it matters for the numbers: other processes holding the cores.

The CPU kernels run many small ops; with several OpenMP threads each op waits at a barrier for every thread,
so when another process holds a core they stall (on a shared 2-core machine the quickstart ran 5-10x slower
with two threads than with one). Benchmarks compare in one run, one thread per process.
"""

import os


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
            "barriers stall behind the other processes (5-10x slower on 2 cores); for timings, run with "
            "OMP_NUM_THREADS=1 or on an idle machine")
