"""Timing a case alone: its turn to time (once every case of its round is warm, one case at a time), the device's
synchronisation and memory around it, the profile of where a step's time goes, and the case's progress lines."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

import torch

GO = "all"  # the driver's file in OUT/ready: every case is warm, timing may begin

_started = time.time()


def progress(message: str) -> None:
    """A line in the case's log with the seconds since it started: where a slow warm-up spends its time."""
    print(f"[{time.time() - _started:6.1f} s] {message}", flush=True)


def safe(name: str) -> str:
    """A case's name as it appears in file names (its log, its results, its mark in OUT/ready)."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def release_memory():
    """Give the caching allocator's free blocks back while waiting for the turn to time: every case's warm-up peak
    held at once would not fit one GPU. The first step inside the turn, untimed, takes them again."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def max_memory_gib(graphs: bool = False):
    """The peak allocated since the last reset; with CUDA graphs, at least what the allocator holds: the graphs'
    private pools keep their memory from the recording, which the peak after a reset does not count (2.2 GiB
    against 6.7 for the same model on an H100)."""
    if not torch.cuda.is_available():
        return 0.0
    peak = torch.cuda.max_memory_allocated()
    return max(peak, torch.cuda.memory_reserved()) / 2**30 if graphs else peak / 2**30


class TurnToTime:
    """Warm up freely, then time alone: say this case is ready, wait until the driver says every case is (no case
    compiles or warms up on the GPU while another is timed), then take an exclusive lock shared by every case."""

    def __init__(self, out: Path):
        self.path, self.out = out / ".timing.lock", out

    def __enter__(self):
        (self.out / "ready" / safe(os.environ.get("GPU_BENCH_JOB", "case"))).touch()
        progress("ready; waiting for every case")
        while not (self.out / "ready" / GO).exists():
            time.sleep(0.2)
        progress("timing")
        self.file = open(self.path, "a")
        fcntl.flock(self.file.fileno(), fcntl.LOCK_EX)
        synchronize()
        return self

    def __exit__(self, *exc):
        synchronize()
        fcntl.flock(self.file.fileno(), fcntl.LOCK_UN)
        self.file.close()


def profile_steps(step, steps: int, top: int = 15) -> tuple[list[dict], float | None]:
    """The device kernels that took the most time over `steps` steps (ms per step each), from torch.profiler: where
    a step's time goes when the attention kernel's own time does not explain it; and the GPU's busy time per step
    (ms; None without CUDA kernels: on the CPU), the union of its kernels' intervals: against the step's wall time
    it says whether the GPU or the host (launching the kernels) bounds the step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        synchronize()
    device_time = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, device_time, 0), reverse=True)[:top]
    kernels = [(e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = busy_us(kernels) / 1000 / steps if kernels else None
    return [{"kernel": e.key[:90], "ms_per_step": getattr(e, device_time, 0) / 1000 / steps,
             "calls_per_step": e.count / steps} for e in rows], busy


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals: the time at least one of them ran (kernels on several
    streams overlap, and are counted once)."""
    total, start, end = 0.0, None, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += 0.0 if end is None else end - start
            start, end = s, e
        else:
            end = max(end, e)
    return total + (0.0 if end is None else end - start)
