"""What a run logs: metrics.jsonl and wandb (MetricsLog), and the line and metrics of every log_interval-th step
(StepLog)."""

import json
import time
from pathlib import Path

import torch

from common.flops import peak_flops
from common.outputs import atomic_write
from runtime.wandb_run import X_AXIS


class MetricsLog:
    """metrics.jsonl (always) and wandb (when enabled); only rank 0 writes."""

    def __init__(self, path: Path, wandb_run=None, on_write_error=None, tokens_at=None):
        """on_write_error(file name, OSError): what a failed write does (a full disk ends the run in one line);
        tokens_at(step): the tokens trained on by that step, which every wandb row carries (its x-axis)."""
        self.path, self.wandb_run, self.on_write_error = path, wandb_run, on_write_error
        self.tokens_at = tokens_at

    def truncate_after(self, step: int, reevaluated: bool = False) -> None:
        """On resume, drop records of steps the interrupted run logged after its last checkpoint (and, when the
        resumed run evaluates again at that step, its evaluation records there), and a last line torn by a kill
        mid-write; the log is rewritten atomically (a kill now leaves the old one or the new)."""
        if not self.path.exists():
            return
        lines = self.path.read_text(errors="replace").splitlines()
        kept = []
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if number < len(lines):  # only the last line can be cut short by a kill
                    raise ValueError(f"{self.path} line {number} is not JSON: the log is damaged; move it aside to "
                                     "resume without it") from None
                print(f"note: dropped the torn last line of {self.path} (the run was killed mid-write)")
                continue
            evaluation = "train_loss" not in record and "window" not in record  # val loss, probes
            if record["step"] < step or record["step"] == step and not (reevaluated and evaluation):
                kept.append(line)
        atomic_write(self.path, lambda f: f.write("".join(line + "\n" for line in kept).encode()))

    def log(self, step: int, to_wandb: bool = True, **values) -> None:
        """A record of step; to_wandb=False keeps it to metrics.jsonl (a record that is not a metric's value)."""
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **values}) + "\n")
        except OSError as e:
            if self.on_write_error is None:
                raise
            self.on_write_error(self.path.name, e)
        if self.wandb_run is not None and to_wandb:
            self.wandb_run.log({**values, X_AXIS: self.tokens_at(step)}, step=step)


def format_eta(seconds: float) -> str:
    seconds = int(seconds)
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class StepLog:
    """The log line and metrics of every log_interval-th step: loss, learning rate, tokens/s, the hooks'
    values, MFU against the device's peak, peak GPU memory, time per step and the time left."""

    def __init__(self, run):
        """run: train.py's Run. Its parts are kept, not the Run itself: main drops the DDP model before closing the
        process group (close_process_group)."""
        self.t, self.rt, self.folder, self.progress = run.cfg.train, run.rt, run.folder, run.progress
        self.tokens_per_step = run.progress.tokens_per_step
        self.flops_per_token = run.raw_model.flops_per_token(run.cfg.model.block_size)
        self.peak = peak_flops(run.rt.device, run.rt.dtype)
        self.start_step, self.t_start, self.t_last = run.progress.step, time.time(), time.time()

    def __call__(self, step: int, train_loss: float, lr: float, hooked: dict) -> None:
        t, rt = self.t, self.rt
        now = time.time()
        dt = (now - self.t_last) / (step - max(self.start_step, step - t.log_interval) or 1)
        self.t_last = now
        tokens_per_s = self.tokens_per_step / dt
        values = {"train_loss": train_loss, "lr": lr, "tokens_per_s": tokens_per_s,
                  "elapsed_s": round(self.progress.elapsed(), 2)}
        line = f"step {step}/{t.max_iters} | loss {train_loss:.4f} | lr {lr:.2e} | {tokens_per_s / 1e3:.1f}k tok/s"
        line += "".join(f" | {key} {value}" for key, value in hooked.items())
        if self.peak is not None:
            values["mfu"] = self.flops_per_token * tokens_per_s / (self.peak * rt.world_size)
            line += f" | mfu {100 * values['mfu']:.1f}%"
        if rt.device.type == "cuda":  # the most this process's tensors have held so far (rank 0's GPU)
            values["max_memory_gib"] = torch.cuda.max_memory_allocated(rt.device) / 2**30
            line += f" | {values['max_memory_gib']:.1f} GiB"
        elapsed_per_step = (now - self.t_start) / (step - self.start_step)
        line += f" | {1000 * dt:.0f} ms/step | eta {format_eta(elapsed_per_step * (t.max_iters - step))}"
        print(line, flush=True)
        self.folder.metrics.log(step, **values)
