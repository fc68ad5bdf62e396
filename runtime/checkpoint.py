"""Checkpoints and run records: atomic checkpoint writes (outputs.py), loading with clear errors, the provenance of
a run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from config import Config
from data.tokenizer import BUILT_IN, TokenizerUnavailable, get_tokenizer
from model import GPT
from common.outputs import atomic_write
from common.run_folder import holds_run

REPO = Path(__file__).resolve().parent.parent


class CheckpointError(Exception):
    pass


def save_checkpoint(obj: dict, path) -> None:
    atomic_write(path, lambda f: torch.save(obj, f))


def remove_stale_temp_files(out_dir) -> None:
    """What a process killed mid-write leaves (the real files beside them are intact): temporary files and
    folders, and a sharded checkpoint's previous folder, which is put back if the kill came between the two
    renames of save_sharded_checkpoint (so that the checkpoint is where it belongs)."""
    for old in Path(out_dir).glob(".old.ckpt_*"):
        current = old.with_name(old.name[len(".old."):])
        if current.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, current)
    for tmp in Path(out_dir).glob(".tmp.*"):
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)


# ---- sharded checkpoints (parallelism=fsdp): one folder per checkpoint, written by every process ---------------

def sharded_checkpoint_path(path) -> Path | None:
    """The folder of a sharded checkpoint: path itself, or, after a kill between save_sharded_checkpoint's two
    renames, the previous complete one beside it; None when there is neither."""
    path = Path(path)
    for candidate in (path, path.with_name(f".old.{path.name}")):
        if (candidate / "meta.pt").exists():
            return candidate
    return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_sharded_checkpoint(path, state: dict, meta: dict, rank: int) -> None:
    """Write a sharded checkpoint folder with torch.distributed.checkpoint (every process writes its shards of
    state, the model's and optimizer's state dicts) plus meta.pt (step, config, RNG states, ...) from rank 0.
    All of it goes to a temporary folder first, renamed over path once complete: a process killed at any
    moment leaves the previous checkpoint loadable (see sharded_checkpoint_path, remove_stale_temp_files)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    tmp, old = path.with_name(f".tmp.{path.name}"), path.with_name(f".old.{path.name}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(state, checkpoint_id=tmp)  # a collective: returns once every process's shards are written
    if rank == 0:
        atomic_write(tmp / "meta.pt", lambda f: torch.save(meta, f))
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def sharded_training_state(model, optimizer) -> dict:
    """The model's and optimizer's state dicts as torch.distributed.checkpoint saves and loads them: each
    process's shards (DTensors), keyed by the bare model's parameter names."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def load_sharded_training_state(path, model, optimizer) -> None:
    """Restore a sharded checkpoint's model and optimizer into a sharded model and its optimizer, resharding
    when the checkpoint was written by another number of processes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = sharded_training_state(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_sharded_meta(path) -> dict:
    """meta.pt of a sharded checkpoint folder (the previous one if a save was interrupted)."""
    found = sharded_checkpoint_path(path)
    if found is None:
        raise CheckpointError(f"no checkpoint at {path}: train a model first (python train.py CONFIG "
                              f"--out_dir={Path(path).parent}), or pick the other one: --ckpt=best|last (sample.py, eval), "
                              "--resume_from=best|last (train.py)")
    try:
        meta = torch.load(found / "meta.pt", map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"cannot read {found / 'meta.pt'} ({type(e).__name__}: {str(e)[:200]}): the folder "
                              "is damaged or was not written by train.py") from None
    meta["path"] = str(found)
    return meta


def load_sharded_model(path, model) -> None:
    """Load a sharded checkpoint's model weights into a bare (unsharded) model in this one process, whatever
    number of processes wrote it: torch.distributed.checkpoint reassembles the shards."""
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=sharded_checkpoint_path(path), no_dist=True)
    model.load_state_dict(state["model"])


def load_checkpoint(path, map_location="cpu") -> dict:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: train a model first (python train.py CONFIG "
                              f"--out_dir={path.parent}), or pick the other one: --ckpt=best|last (sample.py, eval), "
                              "--resume_from=best|last (train.py)")
    if str(map_location).startswith("cuda") and not torch.cuda.is_available():
        raise CheckpointError(f"cannot load {path} onto {map_location}: CUDA is not available here; use --device=cpu")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"cannot read {path} ({type(e).__name__}: {str(e)[:200]}): the file is damaged "
                              "or was not written by train.py; use the other checkpoint (--ckpt=best|last for sample.py "
                              "and eval, --resume_from=best|last for train.py)") from None
    missing = [k for k in ("model", "config", "step") if k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}: it was not written by train.py")
    return ckpt


def checkpoint_path(out_dir, which: str = "best") -> Path:
    """The checkpoint file of a run folder, or its sharded checkpoint folder (parallelism=fsdp)."""
    if which not in ("best", "last"):
        raise CheckpointError(f"ckpt={which!r}: expected best or last")
    single = Path(out_dir) / f"ckpt_{which}.pt"
    sharded = Path(out_dir) / f"ckpt_{which}"
    return sharded if not single.exists() and sharded_checkpoint_path(sharded) is not None else single


def checkpoint_exists(path: Path) -> bool:
    return path.exists() if path.suffix == ".pt" else sharded_checkpoint_path(path) is not None


def load_model(out_dir, which: str = "best", device="cpu"):
    """The trained GPT of a run folder, in eval mode, with its config and the checkpoint (for a sharded one:
    its meta, the weights loaded into the model in this process)."""
    path = checkpoint_path(out_dir, which)
    other = "last" if which == "best" else "best"
    if not checkpoint_exists(path):
        if not checkpoint_exists(checkpoint_path(out_dir, other)):
            held = holds_run(Path(out_dir)) if Path(out_dir).is_dir() else []
            if held:  # a run that stopped before its first checkpoint, or one still training
                raise CheckpointError(f"no checkpoint in {out_dir} yet (neither ckpt_best nor ckpt_last), though it holds "
                                      f"a run ({', '.join(held)}): a run still training writes its first at its first "
                                      "evaluation; one that stopped before it can be trained again over it with "
                                      f"python train.py CONFIG --out_dir={out_dir} --replace_run=True (the old files are "
                                      "moved aside, not deleted)")
            raise CheckpointError(f"no checkpoint in {out_dir} (neither ckpt_best nor ckpt_last): train a model there "
                                  f"first (python train.py CONFIG --out_dir={out_dir}), or give --out_dir the folder "
                                  "of a trained run")
        if which == "last":
            raise CheckpointError(f"no checkpoint at {path}: {out_dir} has only its best checkpoint; use --ckpt=best")
        # no best yet (a run stopped before its first evaluation saved one): the last is what there is
        path = checkpoint_path(out_dir, "last")
        print(f"note: {out_dir} has no best checkpoint; using {path.name}", file=sys.stderr)
    sharded = path.suffix != ".pt"
    ckpt = load_sharded_meta(path) if sharded else load_checkpoint(path, map_location=device)
    ckpt["path"] = str(path)
    cfg = Config.from_dict(ckpt["config"])
    model = GPT(cfg.model)
    if sharded:
        load_sharded_model(path, model)
    else:
        model.load_state_dict(ckpt["model"])
    return model.to(device).eval(), cfg, ckpt


def describe_checkpoint(ckpt: dict) -> str:
    """Which checkpoint was loaded, for the line sample.py and eval print: its file, step and validation loss."""
    loss = ckpt.get("best_val_loss")
    where = ckpt.get("path", "checkpoint")
    best = "ckpt_best" in Path(where).name
    return (f"loaded {where} (step {ckpt.get('step')}" + (f", {'val' if best else 'best val'} loss {loss:.4f}"
                                                          if isinstance(loss, float) and loss != float('inf') else "")
            + ")")


def checkpoint_tokenizer_identity(ckpt: dict) -> dict:
    """The tokenizer a checkpoint was trained with (data.tokenizer.Tokenizer.identity(); its name alone for
    checkpoints written before identities were saved)."""
    return ckpt.get("tokenizer_identity") or {"tokenizer": ckpt["tokenizer"]}


RUN_TOKENIZER = "tokenizer.json"  # a run's own copy of a Hugging Face tokenizer (train.py: keep_tokenizer)


def keep_tokenizer(name: str, out_dir) -> bool:
    """Copy a Hugging Face tokenizer (a tokenizer.json path, a model folder or a hub name) into the run folder as
    tokenizer.json (atomically), so sampling, evaluation and export need nothing outside the run; the built-in
    tokenizers (byte, gpt2) need no copy. Returns whether a copy was written."""
    if name in BUILT_IN or (Path(out_dir) / RUN_TOKENIZER).exists():  # a resumed run has its copy already
        return False
    text = get_tokenizer(name).backend.to_str()
    atomic_write(Path(out_dir) / RUN_TOKENIZER, lambda f: f.write(text.encode()))
    return True


def run_tokenizer(ckpt: dict):
    """The tokenizer of a checkpoint, checked against the vocabulary the model was trained with: the run folder's
    own copy (tokenizer.json beside the checkpoint) where there is one, else loaded by its name (a tokenizer.json
    path or hub name may hold another vocabulary today, and text encoded with it would be other token ids)."""
    identity = checkpoint_tokenizer_identity(ckpt)
    name = identity["tokenizer"]
    where = ckpt.get("path", "the checkpoint")
    copy = Path(ckpt["path"]).parent / RUN_TOKENIZER if "path" in ckpt else None
    try:
        tokenizer = get_tokenizer(str(copy) if copy is not None and copy.exists() and name not in BUILT_IN else name)
    except TokenizerUnavailable as e:
        if name in BUILT_IN:
            raise
        folder = copy.parent if copy is not None else "the run folder"
        local = os.sep in name or name.endswith(".json")
        cause = "no such file any more" if local and not os.path.exists(name) else \
            str(e).splitlines()[0].split(": pass a local")[0]  # the loader's own advice (another tokenizer) left out
        raise CheckpointError(f"the run's tokenizer {name!r} cannot be loaded ({cause}), and {folder} "
                              f"holds no copy of it ({RUN_TOKENIZER}: runs keep one since they were made to): put "
                              f"that tokenizer's tokenizer.json back at {name}, or copy it to {folder}/{RUN_TOKENIZER}; "
                              "another tokenizer would give the model other token ids") from None
    if "vocab_sha256" in identity and tokenizer.identity()["vocab_sha256"] != identity["vocab_sha256"]:
        raise CheckpointError(f"the tokenizer {tokenizer.name!r} found here has another vocabulary than the one "
                              f"{where} was trained with ({identity.get('vocab_size')} tokens): make that name point "
                              "at the original tokenizer files")
    return tokenizer


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
