import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("WANDB_MODE", "offline")  # tests never reach the network
os.environ.setdefault("OMP_NUM_THREADS", "1")  # xdist workers (one per core) and their subprocesses share the cores


def load_script(name: str):
    """scripts/NAME.py as a fresh module, to call its functions in this process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"script_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launcher(processes: int) -> list:
    """python, or torchrun starting that many processes on this machine."""
    return [sys.executable] if processes == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]


def train_subprocess(args, timeout=300, check=True, processes=1):
    """python train.py ARGS as a user runs it, or under torchrun with several processes on this machine."""
    import subprocess

    proc = subprocess.run(launcher(processes) + ["train.py", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def read_metrics(out_dir, key="train_loss") -> dict:
    """{step: value} of one key in a run's metrics.jsonl."""
    import json

    records = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    return {r["step"]: r[key] for r in records if key in r}


def sigterm_after_two_steps(args, out_dir, processes=1):
    """Start python train.py ARGS --out_dir=OUT_DIR (under torchrun with several processes, which passes the
    signal on to them), send SIGTERM once it has logged two steps, and return (returncode, stdout, stderr)
    after it has saved and exited."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen([*launcher(processes), "train.py", *args, f"--out_dir={out_dir}"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = Path(out_dir) / "metrics.jsonl"
    while not (log.exists() and len(read_metrics(out_dir)) >= 2):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err
