"""Checkpoints and run records: atomic writes, loading with clear errors, the provenance of a run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from config import Config

REPO = Path(__file__).resolve().parent


class CheckpointError(Exception):
    pass


def atomic_write(path: str | os.PathLike, write) -> None:
    """Call write(file_object) on a temporary file beside path, fsync it, then rename it over path.

    A crash at any moment leaves either the old file or the new one, never a partial file.
    """
    path = Path(path)
    tmp = path.with_name(f".tmp.{path.name}.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_checkpoint(obj: dict, path) -> None:
    atomic_write(path, lambda f: torch.save(obj, f))


def write_json(obj, path) -> None:
    atomic_write(path, lambda f: f.write((json.dumps(obj, indent=2) + "\n").encode()))


def remove_stale_temp_files(out_dir) -> None:
    """Temporary files left by a process killed mid-write (the real files beside them are intact)."""
    for tmp in Path(out_dir).glob(".tmp.*"):
        tmp.unlink(missing_ok=True)


def load_checkpoint(path, map_location="cpu") -> dict:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: train a model first (python train.py CONFIG "
                              f"--out_dir={path.parent}), or pick the other one with --ckpt=best|last")
    if str(map_location).startswith("cuda") and not torch.cuda.is_available():
        raise CheckpointError(f"cannot load {path} onto {map_location}: CUDA is not available here; use --device=cpu")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"cannot read {path} ({type(e).__name__}: {str(e)[:200]}): the file is damaged "
                              "or was not written by train.py; use the other checkpoint (--ckpt=best|last)") from None
    missing = [k for k in ("model", "config", "step") if k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}: it was not written by train.py")
    return ckpt


def checkpoint_path(out_dir, which: str = "best") -> Path:
    if which not in ("best", "last"):
        raise CheckpointError(f"ckpt={which!r}: expected best or last")
    return Path(out_dir) / f"ckpt_{which}.pt"


def load_model(out_dir, which: str = "best", device="cpu"):
    """The trained GPT of a run folder, in eval mode, with its config and the raw checkpoint."""
    from model import GPT

    ckpt = load_checkpoint(checkpoint_path(out_dir, which), map_location=device)
    cfg = Config.from_dict(ckpt["config"])
    model = GPT(cfg.model)
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval(), cfg, ckpt


def git_hash() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_info(world_size: int = 1) -> dict:
    """What is needed to reproduce a result: the command, the code version, the environment."""
    return {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "git_hash": git_hash(),
        "world_size": world_size,
        "torch": str(torch.__version__),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
