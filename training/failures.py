"""How a run ends on an error: one line saying what went wrong and what to do, and an exit status (2 for a bad
setting, 1 otherwise)."""

import errno
import os
import shutil
import sys
from pathlib import Path


def write_failure(error: Exception, out_dir: Path, name: str, sharded: bool, saved_steps: dict) -> str:
    """The one-line error when a file of the run (a checkpoint, the log, the config) could not be written
    (checkpoint writes are atomic: the previous files are intact): why (a full disk, said as such), which
    checkpoints remain, and the command that resumes, or that starts again when there is none."""
    reasons, cause = [], error
    while cause is not None and len(reasons) < 4:
        reasons.append(getattr(cause, "strerror", None) or str(cause).splitlines()[0][:160])
        full = isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)
        if full:
            break
        cause = cause.__cause__ or cause.__context__
    try:
        free = shutil.disk_usage(out_dir).free
    except OSError:
        free = None
    full = full or (free is not None and free < 64 * 2**20)
    why = (f"the disk holding {out_dir} is full ({free / 2**20:.0f} MiB free)" if full and free is not None
           else "the disk is full" if full else f"{reasons[-1]}")
    intact = [f"{'the previous ' if name.startswith(f'ckpt_{w}') else ''}ckpt_{w}{'' if sharded else '.pt'}"
              + (f" (step {saved_steps[w]})" if w in saved_steps else "")
              for w in ("best", "last") if (out_dir / f"ckpt_{w}{'' if sharded else '.pt'}").exists()]
    resume = f"python train.py {out_dir / 'config.json'} --init_from=resume"
    if intact and not (out_dir / f"ckpt_last{'' if sharded else '.pt'}").exists():
        resume += " --resume_from=best"
    return (f"could not write {name}: {why}. " + (f"{' and '.join(intact)} {'is' if len(intact) == 1 else 'are'} "
                                                   "intact" if intact else "No checkpoint of this run exists yet")
            + (f"; free some space, then resume: {resume}" if intact else
               "; free some space, then start again with --replace_run=True (the partial run is moved aside)"))


def fail(message: str, status: int = 1):
    """Exit with a one-line error. Status 2 is a bad setting, the same on every rank of a torchrun job: only
    rank 0 says it (the others exit quietly with the same status)."""
    if status != 2 or os.environ.get("RANK", "0") == "0":
        print(f"error: {message}", file=sys.stderr)
    sys.exit(status)
