"""Running a step's commands: a time limit that kills the whole process tree, and what came of it."""

import os
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from scripts.gpucheck.options import REPO


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")


def tail(text: str, chars: int = 3000) -> str:
    return text if len(text) <= chars else "..." + text[-chars:]


@dataclass
class Completed:
    command: list
    returncode: int | None  # None: killed at its timeout
    seconds: float
    log: str  # path of its output, relative to the repository when inside it
    output_tail: str
    path: Path | None = None  # the log's absolute path

    def output(self) -> str:
        return self.path.read_text(errors="replace") if self.path else self.output_tail

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def error(self) -> str:
        what = (f"timed out after {self.seconds:.0f} s" if self.timed_out
                else f"exited with status {self.returncode}")
        return f"`{shlex.join(self.command)}` {what} (log: {self.log})\n{self.output_tail}"


_children: set = set()  # running subprocesses, killed with their process groups if the check is interrupted
stopping = threading.Event()  # set by SIGTERM / SIGINT: no new subprocess starts


def descendants(pid: int) -> list[int]:
    """Every process started by pid, and by those, at any depth, whatever session or process group they moved
    to (psutil: by parent pid)."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:  # exited meanwhile
        return []


def kill_tree(proc: subprocess.Popen, reap: bool = True) -> None:
    """Kill proc and every process it started (reap: and wait for proc; a signal handler does not, since the
    Popen it would wait on may be inside wait() in the interrupted code, holding a lock the handler would need). A child that began a session of its own (a nested check's pytest,
    a compile worker) is out of proc's process group, so the tree is walked, not only the group killed. The
    tree is frozen first (SIGSTOP: no process in it starts another, and none is orphaned into another tree
    before it is found), walked again until it stops growing, then killed."""
    tree = set()
    while True:
        new = {proc.pid, *descendants(proc.pid)} - tree
        if not new:
            break
        for pid in new:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        tree |= new
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if reap:
        proc.wait()


def run_command(command: list, log_path: Path, timeout: float, env: dict | None = None, kill_when=None) -> Completed:
    """Run command in the repository with stdout and stderr into log_path, killed (with every process it
    started) when it runs past timeout seconds, or as soon as kill_when() is true (returncode -9)."""
    if stopping.is_set():
        raise RuntimeError(f"not started, the check is stopping: {shlex.join(command)}")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        _children.add(proc)
        deadline = started + max(1.0, timeout)
        try:
            while True:
                try:
                    returncode = proc.wait(timeout=0.05 if kill_when else max(0.0, deadline - time.time()))
                    break
                except subprocess.TimeoutExpired:
                    if kill_when is not None and kill_when():
                        kill_tree(proc)
                        returncode = -signal.SIGKILL
                        break
                    if time.time() >= deadline:
                        kill_tree(proc)
                        returncode = None
                        break
        finally:
            _children.discard(proc)
    seconds = time.time() - started
    output = log_path.read_text(errors="replace")
    shown = log_path.relative_to(REPO) if log_path.is_relative_to(REPO) else log_path
    return Completed(command, returncode, seconds, str(shown), tail(output), log_path)


def stop_children() -> None:
    """Start no more subprocesses and kill the running ones (safe in a signal handler: no lock is taken; each
    run_command reaps its own)."""
    stopping.set()
    for proc in list(_children):
        kill_tree(proc, reap=False)
