"""A run folder belongs to one run: the lock a training run holds on it, the refusal to start a fresh run over
an old one (or to replace it unasked), and the checks that it can be written at all.

    folder = claim(out_dir, fresh=True, replace=False)   # before the run writes anything; held until exit

The lock is an advisory file lock (fcntl.flock) on OUT_DIR/.lock, held for the whole run: the operating system
releases it when the process ends however it ends, so a killed run never leaves a stale lock, and a second
writer is refused with the holder's PID and command (which the lock file records). A run that ends (finished,
stopped, or failed) removes the file; only a run killed outright (SIGKILL, a lost machine) leaves it, unlocked,
and the next run takes it over.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

LOCK_NAME = ".lock"
# what makes a folder hold a run: a checkpoint (file or sharded folder), its log, its config, its evaluations
RUN_FILES = ("ckpt_best.pt", "ckpt_last.pt", "ckpt_best", "ckpt_last", "metrics.jsonl", "config.json", "eval")


class RunFolderError(Exception):
    """The run folder cannot be used: the message names the problem and the fix."""


def writable_folder_problem(path: Path) -> str:
    """Why path cannot be (made and) written as a folder ("" when it can): a file in its place or above it, or
    a folder this process may not write."""
    path = Path(os.path.abspath(path))
    if path.exists() and not path.is_dir():
        return f"{path} is a file, not a folder: give --out_dir a folder's path"
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{path} lies under {existing}, which is a file: give --out_dir a folder's path"
    try:  # a real write of a byte (an empty file fits on a full disk): permissions, read-only mounts, full disks
        with tempfile.TemporaryFile(dir=existing) as probe:
            probe.write(b"x")
            probe.flush()
    except OSError as e:
        return f"{existing} cannot be written ({e.strerror}): give --out_dir a folder you can write"
    return ""


def read_metrics(path: Path, warn=None) -> list[dict]:
    """A run's metrics.jsonl as its records (dicts with a step). A line that is not JSON (one cut short by a run
    killed mid-write) is skipped, and said through warn(message) when given: every reader of the log tolerates
    what a kill leaves, as a resume does."""
    records = []
    for number, line in enumerate(Path(path).read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if warn is not None:
                warn(f"{path}:{number} is not valid JSON; skipped")
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), (int, float)):
            records.append(record)
    return records


def on_current_data(records: list[dict]) -> list[dict]:
    """The records logged since the run's last change of data (a resume with --allow_data_change=True logs a
    data_change record): the ones whose losses compare with each other and with the run's data now."""
    changes = [i for i, record in enumerate(records) if "data_change" in record]
    return records[changes[-1] + 1:] if changes else records


@contextmanager
def held(lock_path: Path):
    """An exclusive lock held for a short read-modify-write of a file that several processes update (two
    evaluations of one run merging their cells into eval/TASK.json): the second waits for the first. The lock
    file is removed on the way out, so a folder keeps none once its writers are done."""
    while True:
        lock_file = open(lock_path, "a")
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        if _still_at(lock_file, lock_path):
            break
        lock_file.close()  # locked a file its last holder removed: lock the one at the path now
    try:
        yield
    finally:
        _unlink_and_close(lock_file, lock_path)


def _still_at(lock_file, lock_path: Path) -> bool:
    """Whether the locked file is still the one at lock_path (a holder removes it as it lets go)."""
    try:
        return os.path.samestat(os.fstat(lock_file.fileno()), os.stat(lock_path))
    except FileNotFoundError:
        return False


def _unlink_and_close(lock_file, lock_path: Path) -> None:
    """Remove the lock file while still holding its lock (a process waiting on it then finds it gone and locks
    a new one), then let go."""
    try:
        if _still_at(lock_file, lock_path):
            os.unlink(lock_path)
    except OSError:  # a folder that cannot be written any more: the lock is released all the same
        pass
    try:
        lock_file.close()  # closing the descriptor drops the flock
    except OSError:  # a full disk refused the holder's record: the descriptor is closed all the same
        pass


def holds_run(path: Path) -> list[str]:
    """The files of a run already in path."""
    return [name for name in RUN_FILES if (path / name).exists()]


def _holder(lock_path: Path, wait_s: float = 1.0) -> str:
    """Who holds the lock, from its record; a holder that has just taken it writes the record at once, so an empty
    one is read again for up to wait_s."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = json.loads(lock_path.read_text())
            return f"PID {info['pid']}, since {info['started']}: {info['command']}"
        except (OSError, ValueError, KeyError, TypeError):
            if time.monotonic() >= deadline:
                return "another process, which has not said which"
            time.sleep(0.05)


class RunFolder:
    """A claimed run folder: its lock is held until release() or the process's end."""

    def __init__(self, path: Path, lock_file, created: bool):
        self.path, self._lock_file, self.created = path, lock_file, created

    def release(self) -> None:
        if self._lock_file is not None:
            _unlink_and_close(self._lock_file, self.path / LOCK_NAME)
            self._lock_file = None

    def _remove_if_unused(self) -> None:
        """At exit: a folder this run created and never wrote into (it failed first) is removed again, while the
        lock is still held (a run that locks it next finds it gone and makes its own, never loses it)."""
        if self._lock_file is not None and self.created and self.path.is_dir() \
                and [p.name for p in self.path.iterdir()] in ([], [LOCK_NAME]):
            shutil.rmtree(self.path, ignore_errors=True)
        self.release()


def _new_folder(path: Path) -> Path:
    """path made as a new folder, or path-2, path-3, ... when it exists (two replacements in one second)."""
    for attempt in range(1, 1000):
        candidate = path if attempt == 1 else path.with_name(f"{path.name}-{attempt}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise RunFolderError(f"cannot make a folder beside {path}: 999 of its names are taken")


def claim(out_dir, fresh: bool, replace: bool = False, command: str | None = None) -> RunFolder:
    """Make out_dir this process's run folder: writable, locked against a second writer, and, for a fresh run
    (not a resume), free of another run's files. replace: move an old run whole to OUT_DIR.replaced-TIME first
    (nothing is deleted)."""
    path = Path(out_dir)
    problem = writable_folder_problem(path)
    if problem:
        raise RunFolderError(problem)
    lock_path = path / LOCK_NAME
    for _ in range(10):
        created = not path.exists()
        try:
            path.mkdir(parents=True, exist_ok=True)
            lock_file = open(lock_path, "a+")
        except OSError as e:
            raise RunFolderError(f"cannot write in {path}: {e.strerror}: give --out_dir a folder you can write") \
                from None
        try:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            lock_file.close()
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunFolderError(f"cannot lock {lock_path}: {e.strerror}") from None
            raise RunFolderError(f"{path} is in use by another training run ({_holder(lock_path)}): wait for it "
                                 "to finish, stop it, or give this run another --out_dir") from None
        if _still_at(lock_file, lock_path):  # the lock of the folder as it is now, not of one a finished run
            break                             # removed (or a failed run's folder) while this one opened it
        lock_file.close()
    else:
        raise RunFolderError(f"cannot lock {lock_path}: the folder keeps being removed and made again")
    folder = RunFolder(path, lock_file, created)
    atexit.register(folder._remove_if_unused)
    try:
        old = holds_run(path)
        if fresh and old:
            if not replace:
                resumable = any(name.startswith("ckpt_") for name in old)
                raise RunFolderError(
                    f"{path} already holds a run ({', '.join(old)}): a fresh run there would mix two models (its "
                    "old checkpoints and evaluations beside the new ones). "
                    + ("Continue it with --init_from=resume, give" if resumable else
                       "It has no checkpoint to resume from. Give")
                    + f" this run another --out_dir, or start over with --replace_run=True (the old run is moved "
                    f"whole to {path.name}.replaced-TIME beside it)")
            _move_aside(path)
        lock_file.seek(0)
        lock_file.truncate()
        lock_file.write(json.dumps({"pid": os.getpid(), "command": command or " ".join(sys.argv),
                                    "started": time.strftime("%Y-%m-%d %H:%M:%S")}))
        lock_file.flush()
    except OSError as e:  # a full disk, a folder that cannot be written beside out_dir
        folder.release()
        raise RunFolderError(f"cannot prepare {path} for the run: {e.strerror or e}: free some space, or give "
                             "--out_dir a folder you can write") from None
    except RunFolderError:
        folder.release()
        raise
    return folder


def _move_aside(path: Path) -> None:
    """Move the old run in path whole into a new folder beside it (nothing is deleted)."""
    if os.stat(path).st_dev != os.stat(path.parent).st_dev:
        raise RunFolderError(f"{path} is a mount point: its old run cannot be moved beside it on the same disk. "
                             "Move or remove the old run yourself, or give this run another --out_dir")
    moved = _new_folder(path.with_name(f"{path.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"))
    for entry in path.iterdir():
        if entry.name != LOCK_NAME:
            os.replace(entry, moved / entry.name)  # one disk: a rename, never a copy
    print(f"the old run in {path} was moved to {moved}", file=sys.stderr)
