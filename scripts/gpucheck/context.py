"""What a step function gets (options, folder, sizes, deadline) and what it returns."""

import sys
import time
from dataclasses import dataclass
from pathlib import Path


from attention import simulate_cuda
from scripts.gpucheck.options import CheckConfig
from scripts.gpucheck.processes import Completed, run_command


@dataclass
class StepContext:
    """What a step function gets: the options, where to write, its sizes and its deadline."""

    cfg: CheckConfig
    device: str  # cuda | cpu
    out: Path
    reduced: str  # "" at full size, else the label shown with every number, e.g. "reduced (CPU, --quick)"
    sizes: dict
    budget_s: float
    started: float
    publish: object  # publish(partial results): rewrite the report with the step still running
    explicit: bool  # the step was named in --steps

    @property
    def python(self) -> str:
        return sys.executable

    @property
    def gpu_path(self) -> bool:
        """Whether the runs take CUDA's path: on CUDA, or on the CPU standing in for it (simulate_cuda)."""
        return simulate_cuda.gpu_path(self.device)

    @property
    def jobs(self) -> int:
        """Processes at a time in steps that compile independent kernels."""
        return self.cfg.jobs or (4 if self.device == "cuda" else 2)

    def remaining(self) -> float:
        return self.budget_s - (time.time() - self.started)

    def run(self, command: list, log_name: str, timeout: float | None = None, env: dict | None = None,
            kill_when=None) -> Completed:
        limit = self.remaining() if timeout is None else min(timeout, self.remaining())
        return run_command(command, self.out / "logs" / f"{log_name}.log", limit, env, kill_when)


def outcome(status: str, summary: str, results=None, error: str = "") -> dict:
    return {"status": status, "summary": summary, "results": results, "error": error}
