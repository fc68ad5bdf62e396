"""A run folder belongs to one run: one writer at a time, no lock left by a killed run, an old run never
overwritten unless asked (and then kept aside), resume from a moved folder or a torn log; and faults (a folder that
cannot be written, a full disk, a missing device) are one line and a non-zero exit, with nothing lost."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, TINY, read_metrics, run_in_process as run, train_in_process


@pytest.mark.e2e
def test_two_trainings_started_on_one_folder_leave_exactly_one_running(tmp_path):
    out = tmp_path / "run"
    args = [sys.executable, "train.py", *TINY, f"--out_dir={out}", "--max_iters=30", "--eval_interval=10"]
    first = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    second = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = [(p.wait(timeout=300), *p.communicate()) for p in (first, second)]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], results
    refused = next(err for code, _, err in results if code == 2)
    winner = first if results[0][0] == 0 else second
    assert "is in use by another training run" in refused or "already holds a run" in refused, refused
    if "in use" in refused:  # it names the holder
        assert f"PID {winner.pid}" in refused and "train.py" in refused
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if "train_loss" in line]
    assert steps == list(range(1, 31))  # one run's log: strictly increasing, nothing interleaved
    from runtime.checkpoint import load_checkpoint

    assert load_checkpoint(out / "ckpt_last.pt")["step"] == 30 and load_checkpoint(out / "ckpt_best.pt")


@pytest.mark.e2e
def test_a_killed_run_leaves_no_lock_behind(tmp_path):
    import signal
    import time

    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "train.py", *TINY, f"--out_dir={out}", "--max_iters=2000",
                             "--eval_interval=5"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not (out / "ckpt_last.pt").exists():
        assert proc.poll() is None
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    from common.run_folder import claim

    claim(out, fresh=False).release()  # the kernel dropped the dead process's lock
    resumed = train_in_process([*TINY, f"--out_dir={out}", "--max_iters=12", "--eval_interval=5",
                                "--init_from=resume"], check=False)
    assert resumed.returncode == 0, resumed.stderr


@pytest.mark.e2e
def test_a_fresh_run_never_starts_over_an_old_one_unless_asked(byte_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(byte_run, run_dir)
    (run_dir / "eval").mkdir(exist_ok=True)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    proc = train_in_process([*TINY, f"--out_dir={run_dir}", "--max_iters=4", "--eval_interval=4"], check=False)
    assert proc.returncode == 2 and "already holds a run" in proc.stderr, proc.stderr
    assert "--init_from=resume" in proc.stderr and "--replace_run=True" in proc.stderr
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before  # nothing touched
    proc = train_in_process([*TINY, f"--out_dir={run_dir}", "--max_iters=4", "--eval_interval=4",
                             "--replace_run=True", "--seed=7"])
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(moved) == 1 and (moved[0] / "ckpt_best.pt").read_bytes() == before["ckpt_best.pt"]
    assert (moved[0] / "eval").is_dir() and not (run_dir / "eval").exists()  # the old run moved whole
    assert max(read_metrics(run_dir)) == 4


def test_replacing_twice_in_one_second_keeps_both_old_runs_and_an_unused_folder_goes_under_its_lock(tmp_path,
                                                                                                      monkeypatch):
    from common import run_folder

    monkeypatch.setattr(run_folder.time, "strftime", lambda *_: "20260101-000000")
    path = tmp_path / "run"
    for log in ("first", "second", "third"):
        folder = run_folder.claim(path, fresh=True, replace=True)
        (path / "metrics.jsonl").write_text(log)
        folder.release()
    moved = sorted(p.name for p in tmp_path.iterdir() if p.name != "run")
    assert moved == ["run.replaced-20260101-000000", "run.replaced-20260101-000000-2"]
    assert (tmp_path / moved[1] / "metrics.jsonl").read_text() == "second"
    unused = run_folder.claim(tmp_path / "unused", fresh=True)
    unused._remove_if_unused()
    assert not (tmp_path / "unused").exists() and unused._lock_file is None
    used = run_folder.claim(tmp_path / "used", fresh=True)
    (tmp_path / "used" / "config.json").write_text("{}")
    used._remove_if_unused()
    assert (tmp_path / "used" / "config.json").exists()


@pytest.mark.e2e
def test_sample_and_eval_say_which_checkpoint_they_loaded(byte_run):
    proc = run(["sample.py"], f"--out_dir={byte_run}", "--max_new_tokens=4", "--num_samples=1")
    assert proc.returncode == 0 and f"loaded {byte_run / 'ckpt_best.pt'} (step " in proc.stderr
    assert "val loss" in proc.stderr and "loaded" not in proc.stdout  # stdout: the samples alone


@pytest.mark.e2e
def test_a_moved_run_folder_resumes_where_its_config_lies(byte_run, tmp_path):
    moved = tmp_path / "elsewhere" / "moved_run"
    moved.parent.mkdir()
    shutil.copytree(byte_run, moved)
    proc = train_in_process([str(moved / "config.json"), "--init_from=resume", "--max_iters=12"])
    assert max(read_metrics(moved)) == 12 and max(read_metrics(byte_run)) == 8  # the original is untouched
    assert "resumed from " + str(moved / "ckpt_last.pt") in proc.stdout


@pytest.mark.e2e
def test_resume_tolerates_a_torn_last_log_line_and_logs_each_validation_once(byte_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(byte_run, run_dir)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "train_lo')  # a kill in the middle of a write
    proc = train_in_process([*TINY, f"--out_dir={run_dir}", "--max_iters=12", "--eval_interval=4",
                             "--init_from=resume"])
    assert "dropped the torn last line" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    validations = [r["step"] for r in records if "val_loss" in r]
    assert validations == [0, 4, 8, 12]  # step 8 evaluated again on resume, logged once
    assert [r["step"] for r in records if "train_loss" in r] == list(range(1, 13))


@pytest.mark.e2e
def test_max_iters_zero_claims_no_checkpoint(tmp_path):
    proc = train_in_process([*TINY, f"--out_dir={tmp_path / 'run'}", "--max_iters=0"])
    assert "no checkpoint written" in proc.stdout and "checkpoints in" not in proc.stdout
    assert not list((tmp_path / "run").glob("ckpt_*"))


@pytest.mark.e2e
@pytest.mark.parametrize("where", ["file", "under_file", "read_only"])
def test_an_out_dir_that_cannot_be_written_is_one_line_before_the_run_starts(tmp_path, where, byte_run):
    (tmp_path / "a_file").write_text("x")
    out = {"file": tmp_path / "a_file", "under_file": tmp_path / "a_file" / "run", "read_only": "/proc/run"}[where]
    for command in (["train.py", *TINY, "--max_iters=2"], ["-m", "eval", "--progress=False"]):
        if command[0] == "-m":  # eval writes into the run folder: a readable run whose folder cannot be written
            if where != "read_only":
                continue
            out = "/proc/self"
        proc = run(command, f"--out_dir={out}")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip().count("\n") == 0 and ("is a file" in proc.stderr or "cannot be written" in proc.stderr)
    assert (tmp_path / "a_file").read_text() == "x"


@pytest.mark.e2e
def test_a_full_disk_during_a_checkpoint_is_one_line_naming_what_is_intact(tmp_path, monkeypatch):
    import errno

    from runtime import checkpoint

    real, calls = checkpoint.save_checkpoint, []

    def save_then_fill_the_disk(obj, path):
        calls.append(path.name)
        if len(calls) > 2:  # ckpt_best.pt and ckpt_last.pt at step 4 are written, then the disk is full
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError as e:
                raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed") from e
        real(obj, path)

    monkeypatch.setattr(checkpoint, "save_checkpoint", save_then_fill_the_disk)  # what train.py imports as it starts
    out = tmp_path / "run"
    proc = train_in_process([*TINY, f"--out_dir={out}", "--max_iters=8", "--eval_interval=4", "--device=cpu"],
                            check=False)
    assert proc.returncode == 1, proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: could not write ckpt_") and "is full" in error
    assert "ckpt_best.pt (step 4)" in error and "ckpt_last.pt (step 4)" in error and "intact" in error
    assert f"python train.py {out / 'config.json'} --init_from=resume" in error
    from runtime.checkpoint import load_checkpoint

    assert load_checkpoint(out / "ckpt_last.pt")["step"] == 4  # the previous checkpoint, whole


@pytest.mark.e2e
def test_a_full_disk_outside_a_checkpoint_is_one_line_and_the_advice_works(tmp_path, monkeypatch):
    import builtins
    import errno

    import training.metrics

    def full_for_the_log(path, mode="r", *args, **kwargs):
        if str(path).endswith("metrics.jsonl") and "a" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return builtins.open(path, mode, *args, **kwargs)

    out = tmp_path / "run"
    with monkeypatch.context() as patch:  # the disk fills when the log first grows (MetricsLog's writes)
        patch.setattr(training.metrics, "open", full_for_the_log, raising=False)
        proc = train_in_process([*TINY, f"--out_dir={out}", "--max_iters=4", "--eval_interval=4", "--device=cpu"],
                                check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: could not write metrics.jsonl") and "is full" in error
    assert "No checkpoint of this run exists yet" in error and "--replace_run=True" in error
    # the advice works: the folder holds a partial run without a checkpoint, which a plain rerun refuses
    # without offering a resume, and --replace_run=True starts over
    proc = train_in_process([*TINY, f"--out_dir={out}", "--max_iters=2", "--eval_interval=2"], check=False)
    assert proc.returncode == 2 and "no checkpoint to resume from" in proc.stderr, proc.stderr
    assert "--init_from=resume" not in proc.stderr and "--replace_run=True" in proc.stderr
    train_in_process([*TINY, f"--out_dir={out}", "--max_iters=2", "--eval_interval=2", "--replace_run=True"])
    assert max(read_metrics(out)) == 2


def test_a_folder_that_cannot_take_the_old_run_aside_is_one_line(tmp_path, monkeypatch):
    import errno

    from common import run_folder

    path = tmp_path / "run"
    path.mkdir()
    (path / "metrics.jsonl").write_text("{}\n")

    def cross_device(*_):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(run_folder.os, "replace", cross_device)
    with pytest.raises(run_folder.RunFolderError, match="cannot prepare .*Invalid cross-device link"):
        run_folder.claim(path, fresh=True, replace=True)
    assert (path / "metrics.jsonl").read_text() == "{}\n"  # nothing lost
    run_folder.claim(path, fresh=False).release()  # and the lock was released


@pytest.mark.parametrize("command", [["train.py", "configs/quickstart.py", "--max_iters=1"], ["sample.py"],
                                     ["-m", "eval"]])
@pytest.mark.e2e
def test_a_device_this_machine_lacks_is_one_line(command, tmp_path):
    proc = run(command, "--device=mps", f"--out_dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and "mps" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_run_started_at_the_same_moment_as_another_is_told_the_others_pid(tmp_path):
    import threading

    from common.run_folder import LOCK_NAME, RunFolderError, claim

    first = claim(tmp_path / "run", fresh=True, command="python train.py first")
    record = (tmp_path / "run" / LOCK_NAME).read_text()
    (tmp_path / "run" / LOCK_NAME).write_text("")  # the first has the lock and has not written its record yet
    writer = threading.Timer(0.2, lambda: (tmp_path / "run" / LOCK_NAME).write_text(record))
    writer.start()
    try:
        with pytest.raises(RunFolderError, match=rf"in use by another training run \(PID {os.getpid()}, since .*: "
                                                 r"python train.py first\)"):
            claim(tmp_path / "run", fresh=True)
    finally:
        writer.join()
        first.release()
