"""End-to-end training runs as a user runs them (tiny models on the embedded corpus): in this process
(conftest.run_in_process), and in processes of their own where signals, kills and torchrun are what is checked."""

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from runtime.checkpoint import load_checkpoint
from common.outputs import atomic_write
from conftest import REPO, read_metrics, run_in_process, sigterm_after_two_steps, train_in_process, train_subprocess

TINY = ["configs/quickstart.py", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4",
        "--eval_iters=2", "--log_interval=1", "--warmup_iters=2", "--lr_decay_iters=12", "--dropout=0.1"]


def run(args, out_dir, check=True, torchrun=False):
    if torchrun:
        return train_subprocess([*TINY, f"--out_dir={out_dir}", *args], 300, check, processes=2)
    return train_in_process([*TINY, f"--out_dir={out_dir}", *args], check)


def metrics(out_dir, key="train_loss"):
    return read_metrics(out_dir, key)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """12 uninterrupted steps with dropout, evaluating and checkpointing every 4."""
    out = tmp_path_factory.mktemp("reference")
    run(["--max_iters=12", "--eval_interval=4"], out)
    return out


@pytest.mark.e2e
def test_run_writes_its_outputs(reference_run):
    for name in ("ckpt_best.pt", "ckpt_last.pt", "config.json", "metrics.jsonl"):
        assert (reference_run / name).exists(), name
    assert not (reference_run / ".lock").exists()  # a finished run leaves no lock file (docs/training.md)
    saved = json.load(open(reference_run / "config.json"))
    assert saved["train"]["max_iters"] == 12 and saved["model"]["vocab_size"] == 320  # 257 padded to 64
    assert "git_hash" in saved["run"] and "train.py" in saved["run"]["command"]
    assert saved["data"]["dataset"] == "embedded_byte" and saved["data_meta"]["vocab_size"] == 257
    ckpt = load_checkpoint(reference_run / "ckpt_last.pt")
    assert ckpt["step"] == 12 and ckpt["data_cursor"]["step"] == 12
    assert set(metrics(reference_run, "val_loss")) == {0, 4, 8, 12}
    assert len(metrics(reference_run)) == 12


@pytest.mark.e2e
def test_resume_reproduces_the_uninterrupted_run(reference_run, tmp_path):
    run(["--max_iters=6", "--eval_interval=4", "--ckpt_interval=3"], tmp_path)
    run(["--max_iters=12", "--eval_interval=4", "--init_from=resume"], tmp_path)
    assert metrics(tmp_path) == metrics(reference_run)  # exact, including dropout noise after step 6
    resumed_val = metrics(tmp_path, "val_loss")
    assert resumed_val.pop(6)  # the first run's final evaluation; every other one matches
    assert resumed_val == metrics(reference_run, "val_loss")


@pytest.mark.e2e
def test_a_resumed_run_keeps_every_command_and_says_when_its_best_was_measured_otherwise(tmp_path):
    run(["--max_iters=4", "--eval_interval=4"], tmp_path)
    first = json.load(open(tmp_path / "config.json"))["invocations"]
    assert len(first) == 1 and first[0]["from_step"] == 0 and "--max_iters=4" in first[0]["command"]
    proc = run(["--max_iters=8", "--eval_interval=4", "--eval_iters=3", "--init_from=resume"], tmp_path)
    saved = json.load(open(tmp_path / "config.json"))
    assert [i["command"] for i in saved["invocations"][:1]] == [first[0]["command"]]  # the first command kept
    second = saved["invocations"][1]
    assert second["from_step"] == 4 and "--init_from=resume" in second["command"]
    assert second["changed"]["train.max_iters"] == [4, 8] and second["changed"]["eval.eval_iters"] == [2, 3]
    assert saved["run"] == {k: v for k, v in second.items() if k not in ("from_step", "changed")}
    # the best loss of the first invocation was measured over 2 batches, this one's over 3: every line says so
    assert "that best val loss was measured with eval_iters=2" in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step 4: val loss")]
    assert lines and all("measured before the resume with eval_iters=2" in line or
                         float(line.split("best ")[1].rstrip(")")) == float(line.split("val loss ")[1].split()[0])
                         for line in lines), lines
    assert load_checkpoint(tmp_path / "ckpt_last.pt")["best_val_budget"]["eval_iters"] in (2, 3)
    # what "auto" became (compare shows it), and the wall time counted over both invocations
    assert saved["model"]["pos_embedding"] == "auto" and saved["resolved"]["pos_embedding"] == "learned"
    assert saved["resolved"]["attn_backend"] == "sdpa" and saved["resolved"]["device"] == "cpu"
    elapsed = metrics(tmp_path, "elapsed_s")
    assert elapsed[8] > elapsed[4] > 0 and elapsed[5] >= elapsed[4]  # step 5 (resumed) counts on from step 4


@pytest.mark.e2e
def test_sigterm_saves_and_resume_is_exact(tmp_path):
    # stopped whenever the signal lands, long before its max_iters; the reference runs a few steps past that (the
    # learning rate follows lr_decay_iters, not max_iters)
    returncode, out, err = sigterm_after_two_steps([*TINY, "--max_iters=1000", "--eval_interval=4"], tmp_path)
    assert returncode == 128 + signal.SIGTERM, err
    stopped = load_checkpoint(tmp_path / "ckpt_last.pt")["step"]
    assert 2 <= stopped < 1000 and f"at step {stopped}" in out
    args = [f"--max_iters={stopped + 6}", "--eval_interval=4"]
    ref = tmp_path / "ref"
    run(args, ref)
    run([*args, "--init_from=resume"], tmp_path)
    assert metrics(tmp_path) == metrics(ref)


@pytest.mark.e2e
def test_sigkill_while_checkpointing_keeps_the_last_checkpoint(tmp_path):
    cmd = [sys.executable, "train.py", *TINY, f"--out_dir={tmp_path}", "--max_iters=1000", "--ckpt_interval=1",
           "--n_embd=256", "--n_layer=4"]  # a ~13 MB checkpoint written after every step
    rng = random.Random(0)
    for attempt in range(2):  # a fresh run, then a resumed one
        proc = subprocess.Popen(cmd + (["--init_from=resume"] if attempt else []), cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        last = tmp_path / "ckpt_last.pt"
        start = time.time()
        while not last.exists() or time.time() - start < 4 + 2 * attempt:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.01)
        time.sleep(rng.random() * 0.3)
        proc.kill()
        proc.wait()
        ckpt = load_checkpoint(last)  # the previous complete checkpoint, whatever the kill interrupted
        assert ckpt["step"] >= 1


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "ckpt_last.pt"
    torch.save({"step": 1}, path)

    def crash(f):
        f.write(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, crash)
    assert torch.load(path)["step"] == 1
    assert os.listdir(tmp_path) == ["ckpt_last.pt"]


@pytest.mark.e2e
def test_ddp_two_processes_match_one(tmp_path):
    args = ["--max_iters=4", "--eval_interval=4", "--gradient_accumulation_steps=2", "--dropout=0.0"]
    run(args, tmp_path / "single")
    run(args, tmp_path / "ddp", torchrun=True)
    single, ddp = metrics(tmp_path / "single"), metrics(tmp_path / "ddp")
    assert single.keys() == ddp.keys() == {1, 2, 3, 4}
    for step in single:
        assert abs(single[step] - ddp[step]) < 1e-5, (step, single[step], ddp[step])
    val_single, val_ddp = metrics(tmp_path / "single", "val_loss"), metrics(tmp_path / "ddp", "val_loss")
    assert all(abs(val_single[s] - val_ddp[s]) < 1e-5 for s in val_single)
    assert json.load(open(tmp_path / "ddp" / "config.json"))["run"]["world_size"] == 2


@pytest.mark.e2e
def test_non_finite_loss_stops_and_keeps_checkpoints(tmp_path):
    run(["--max_iters=4", "--eval_interval=2"], tmp_path)
    before = (tmp_path / "ckpt_last.pt").read_bytes()
    proc = run(["--max_iters=40", "--eval_interval=2", "--init_from=resume", "--learning_rate=1e9", "--min_lr=1e9",
                "--grad_clip=0"], tmp_path, check=False)
    assert proc.returncode == 1 and "training loss is" in proc.stderr and "last good step" in proc.stderr
    assert "ckpt_last.pt" in proc.stderr and "float16" not in proc.stderr  # a float32 run: no dtype advice
    assert (tmp_path / "ckpt_last.pt").read_bytes() == before
    # diverging before any checkpoint exists: the message does not claim one
    proc = run(["--max_iters=40", "--eval_interval=1000", "--learning_rate=1e9", "--min_lr=1e9", "--grad_clip=0"],
               tmp_path / "fresh", check=False)
    assert proc.returncode == 1 and "no checkpoint was written" in proc.stderr
    assert not list((tmp_path / "fresh").glob("ckpt_*"))


@pytest.mark.parametrize("args, message", [(["--start=FILE:/nonexistent/prompt.txt"], "cannot read the prompt file"),
                                           (["--max_new_tokens=-1"], "max_new_tokens=-1: must be >= 0"),
                                           (["--top_p=0"], "top_p=0.0: must be in (0, 1]"),
                                           (["--ckpt=middle"], "ckpt=middle: must be best or last")])
@pytest.mark.e2e
def test_sample_rejects_bad_options_in_one_line(reference_run, args, message):
    proc = run_in_process(["sample.py"], f"--out_dir={reference_run}", *args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.e2e
def test_sample_generates_from_a_checkpoint(reference_run, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Once upon a time")
    args = [f"--out_dir={reference_run}", f"--start=FILE:{prompt}", "--num_samples=2", "--max_new_tokens=20",
            "--top_p=0.9", "--seed=3"]
    proc = run_in_process(["sample.py"], *args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("Once upon a time") == 2 and proc.stdout.count("---------------") == 2
    torch.manual_seed(1)  # the global generator elsewhere: the samples come from --seed alone
    again = run_in_process(["sample.py"], *args)
    assert again.stdout == proc.stdout  # seeded


def test_a_sample_shows_each_end_of_text_token_and_can_stop_at_the_first():
    from data.tokenizer import get_tokenizer
    from sample import sample_text

    for name in ("byte", "gpt2"):  # the byte tokenizer's decode drops the token; GPT-2's prints it
        tok = get_tokenizer(name)
        ids = tok.encode("Once") + tok.encode(" upon") + [tok.eot_id] + tok.encode("Next doc") + [tok.eot_id]
        assert sample_text(tok, ids, 1) == "Once upon<|endoftext|>Next doc<|endoftext|>", name
        assert sample_text(tok, ids, 1, stop_at_eot=True) == "Once upon", name


@pytest.mark.e2e
def test_sample_reports_a_missing_checkpoint(tmp_path):
    proc = run_in_process(["sample.py"], f"--out_dir={tmp_path}")
    assert proc.returncode == 1 and "no checkpoint in" in proc.stderr and "neither ckpt_best nor ckpt_last" in proc.stderr
    assert "pick the other one" not in proc.stderr  # there is no other one


@pytest.mark.e2e
def test_wandb_offline_logs_and_resume_keeps_the_run_id(tmp_path):
    args = ["--eval_interval=2", "--wandb_log=True", "--wandb_mode=offline"]
    run(["--max_iters=2", *args], tmp_path)
    first = load_checkpoint(tmp_path / "ckpt_last.pt")["wandb_run_id"]
    run(["--max_iters=4", "--init_from=resume", *args], tmp_path)
    assert first and load_checkpoint(tmp_path / "ckpt_last.pt")["wandb_run_id"] == first
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{first}"))
    assert len(runs) == 2  # one folder per process lifetime, both for the same run id


def test_evaluation_builds_no_autograd_graph():
    # evaluation holds one batch's activations at a time: no tensor is saved for a backward that never comes
    from contextlib import nullcontext

    from config import ModelConfig
    from data.loader import WindowSampler
    from data.meta import load_meta, open_tokens
    from data.prepare import prepare_generated_if_missing
    from eval.probes import training_probes
    from model import GPT
    from training.evaluation import evaluate

    data_dir = str(REPO / "data" / "embedded_byte")
    prepare_generated_if_missing(data_dir)
    meta = load_meta(data_dir)
    model = GPT(ModelConfig(arch="llama", bias=False, n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=320))
    val = WindowSampler(data_dir, "val", 32, 4, 3, device="cpu")
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        loss = evaluate(model, val, 3, 0, 1, nullcontext(), torch.device("cpu"))
        probes = training_probes(model, ["ppl", "niah"], [512], open_tokens(data_dir, "val"), meta["eot_id"],
                                 meta["tokenizer"], 0, "cpu", ppl_max_tokens=2000, niah_samples=1)
    assert saved == [] and math.isfinite(loss) and set(probes) == {"ppl@512", "niah@512"}
    assert model.training  # evaluation puts the model back in training mode


def test_rng_restore_refuses_states_that_are_not_cpu_byte_tensors():
    # a checkpoint loaded with map_location=cuda holds GPU tensors; torch.set_rng_state takes CPU ByteTensors only
    from runtime.checkpoint import CheckpointError
    from training.rng import rng_state, set_rng_state

    state = rng_state()
    set_rng_state(state)
    for bad in (state["torch"].to("meta"), state["torch"].float(), state["torch"].tolist()):
        with pytest.raises(CheckpointError, match="map_location='cpu'"):
            set_rng_state({**state, "torch": bad})


@pytest.mark.e2e
def test_cuda_requested_where_there_is_none_is_one_line_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no GPU, even on a GPU machine
    proc = run(["--device=cuda"], tmp_path / "run", check=False)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: device=cuda but CUDA is not available")
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_accumulation_that_does_not_divide_among_processes_is_reported_once(tmp_path):
    proc = run(["--gradient_accumulation_steps=3"], tmp_path / "run", check=False, torchrun=True)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: gradient_accumulation_steps=3 is not divisible by the number of processes (2); "
                      "choose a multiple of 2"]  # rank 0's line only
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_a_folder_that_holds_a_run_is_refused_once_under_torchrun(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    proc = run(["--gradient_accumulation_steps=2"], tmp_path / "run", check=False, torchrun=True)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "already holds a run" in errors[0], proc.stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == "" and not (tmp_path / "run" / "config.json").exists()


@pytest.mark.e2e
def test_a_runs_saved_config_json_trains_the_same_run(reference_run, tmp_path):
    train_in_process([str(reference_run / "config.json"), f"--out_dir={tmp_path}"])
    assert metrics(tmp_path) == metrics(reference_run)
    saved, again = (json.load(open(path / "config.json")) for path in (reference_run, tmp_path))
    assert {**saved["model"]} == again["model"] and saved["train"]["max_iters"] == again["train"]["max_iters"]


@pytest.mark.parametrize("vocab_size, message", [(100, "says vocab_size 100 and eot_id 256, but its tokenizer 'byte' has 257"),
                                                 (50257, "says vocab_size 50257")])
@pytest.mark.e2e
def test_a_meta_that_does_not_describe_its_data_is_refused_before_anything_is_written(tmp_path, vocab_size, message):
    import shutil

    from data.prepare import prepare_generated_if_missing

    source = REPO / "data" / "embedded_byte"
    prepare_generated_if_missing(str(source))
    data = tmp_path / "data"
    shutil.copytree(source, data)
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps({**meta, "vocab_size": vocab_size, "dtype": "uint16"}))
    proc = train_in_process(["configs/quickstart.py", f"--data_dir={data}", f"--out_dir={tmp_path / 'run'}",
                             "--max_iters=1"], check=False)
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1 and "python -m data.prepare" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_online_wandb_without_a_login_says_to_log_offline_before_the_run_starts(tmp_path, monkeypatch):
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no login
    proc = train_in_process(["configs/quickstart.py", "--wandb_log=True", f"--out_dir={tmp_path / 'run'}"],
                            check=False)
    assert proc.returncode == 2 and "--wandb_mode=offline" in proc.stderr and "no wandb login" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()
    # in a process of its own (with the environment above): wandb's client keeps what it read at its first use in
    # a process, and this one may have used it offline
    proc = subprocess.run([sys.executable, "-m", "scripts.compare", "--wandb", "someone/project"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "compare the local run folders instead" in proc.stderr, proc.stderr[-1500:]
    assert "Traceback" not in proc.stderr


@pytest.mark.e2e
def test_resume_from_best_a_finished_run_and_the_last_checkpoint_when_there_is_no_best(reference_run, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(reference_run, run_dir)
    lines = (run_dir / "metrics.jsonl").read_text()
    proc = run(["--max_iters=12", "--eval_interval=4", "--init_from=resume"], run_dir)
    assert "already finished at step 12" in proc.stdout
    assert (run_dir / "metrics.jsonl").read_text() == lines  # no second val line for step 12
    best_step = load_checkpoint(run_dir / "ckpt_best.pt")["step"]
    proc = run(["--max_iters=14", "--eval_interval=4", "--init_from=resume", "--resume_from=best"], run_dir)
    assert f"resumed from {run_dir / 'ckpt_best.pt'} at step {best_step}" in proc.stdout
    (run_dir / "ckpt_best.pt").unlink()  # e.g. a run stopped before its first evaluation
    sample = run_in_process(["sample.py"], f"--out_dir={run_dir}", "--max_new_tokens=4", "--num_samples=1",
                            "--device=cpu")
    assert sample.returncode == 0 and "no best checkpoint; using ckpt_last.pt" in sample.stderr, sample.stderr[-1500:]


def test_the_learning_rate_decays_over_max_iters_unless_told_otherwise():
    from config import load_config
    from training.schedules import get_lr, schedule_warning

    # the README's own-text recipe: the quickstart config with --max_iters=2000
    t = load_config(["configs/quickstart.py", "--max_iters=2000"]).train
    assert get_lr(1500, t) > t.min_lr * 1.5 and get_lr(1999, t) < t.min_lr * 1.01 and not schedule_warning(t)
    t = load_config(["configs/quickstart.py", "--max_iters=400"]).train
    assert get_lr(399, t) < t.min_lr * 1.01  # a shorter run decays fully too
    t = load_config(["configs/quickstart.py", "--max_iters=2000", "--lr_decay_iters=800"]).train
    assert get_lr(1500, t) == t.min_lr and "stays there for the last 60% of training" in schedule_warning(t)
    assert "before min_lr" in schedule_warning(load_config(["configs/quickstart.py", "--lr_decay_iters=4000"]).train)


@pytest.mark.e2e
def test_resume_refuses_data_whose_identity_differs_from_the_runs(reference_run, tmp_path):
    out, data = tmp_path / "run", tmp_path / "data"
    shutil.copytree(reference_run, out)
    shutil.copytree(REPO / "data" / "embedded_byte", data)
    meta = json.loads((data / "meta.json").read_text())
    meta["split"] = {**meta["split"], "val_fraction": 0.02}  # as a re-preparation with another split records it
    (data / "meta.json").write_text(json.dumps(meta))
    proc = run(["--max_iters=14", "--init_from=resume", f"--data_dir={data}"], out, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert "is not the data the run" in error and "val_fraction" in error and "--allow_data_change=True" in error
    assert load_checkpoint(out / "ckpt_last.pt")["step"] == 12  # nothing trained, nothing written
    val = data / "val.bin"  # other validation text of the same size: its losses differ from the run's
    val.write_bytes(np.fromfile(val, dtype=np.uint16)[::-1].tobytes())
    before = (out / "metrics.jsonl").read_text()
    best_before = (out / "ckpt_best.pt").read_bytes()
    proc = run(["--max_iters=16", "--init_from=resume", f"--data_dir={data}", "--allow_data_change=True"], out)
    assert "data changed at step 12" in proc.stdout and "val_fraction" in proc.stdout
    assert load_checkpoint(out / "ckpt_last.pt")["step"] == 16

    # every record of the run before the change stays as it was, then the change, then the new data's records
    after = (out / "metrics.jsonl").read_text()
    assert after.startswith(before), "a record of the run was dropped or rewritten"
    records = [json.loads(line) for line in after[len(before):].splitlines()]
    change = records[0]
    assert change["step"] == 12 and "val_fraction" in change["data_change"]["changes"][0]
    assert change["data_change"]["before"]["split"] != change["data_change"]["after"]["split"]
    old_val = [r["val_loss"] for r in map(json.loads, before.splitlines()) if "val_loss" in r and r["step"] == 12]
    new_val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert sorted(new_val) == [12, 16] and new_val[12] != old_val[0]  # step 12 evaluated again, on the new data
    assert [r["best_val_loss"] for r in records if "val_loss" in r] == [new_val[12], min(new_val.values())]

    # the earlier best is kept under a name that says so; ckpt_best, eval's default, is the new data's best
    assert (out / "ckpt_best_data_before_step12.pt").read_bytes() == best_before
    best = load_checkpoint(out / "ckpt_best.pt")
    assert best["best_val_loss"] == min(new_val.values()) and best["step"] == min(new_val, key=new_val.get)
    from eval.__main__ import best_val_loss
    from eval.records import load_local_run
    assert best_val_loss(out) == min(new_val.values())  # eval's "the run's best validation loss in training"
    record = load_local_run(out)
    assert record["best_val_loss"] == min(new_val.values()) and [s for s, _ in record["val"]] == [12, 16]
    assert "val_fraction" in json.loads((out / "config.json").read_text())["invocations"][-1]["data_change"][0]


@pytest.mark.e2e
def test_a_stop_during_a_long_evaluation_is_said_at_once_and_a_second_one_stops_now(reference_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference_run, out)
    saved = (out / "ckpt_last.pt").read_bytes()
    # resumed at step 12, the loop starts with an evaluation of minutes
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen([sys.executable, "train.py", *TINY, "--max_iters=40", "--eval_interval=4",
                                 "--eval_iters=100000", "--init_from=resume", f"--out_dir={out}"], cwd=REPO,
                                stdout=stdout, stderr=stderr, text=True)
    try:
        while "unigram baseline" not in (tmp_path / "stdout").read_text():  # set up: the evaluation comes next
            assert proc.poll() is None, (tmp_path / "stderr").read_text()
            time.sleep(0.05)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        while "stopping after" not in (tmp_path / "stderr").read_text() and time.monotonic() - start < 5:
            time.sleep(0.05)
        assert "SIGINT: stopping after step 13" in (tmp_path / "stderr").read_text()  # during the evaluation
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)  # at once: the evaluation had minutes to go
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT
    assert "stopping now" in (tmp_path / "stderr").read_text()
    assert (out / "ckpt_last.pt").read_bytes() == saved  # the last complete checkpoint, untouched


def test_the_model_line_says_when_the_vocabulary_is_most_of_the_model_and_when_documents_are_masked(tmp_path):
    # GPT-2's vocabulary at the quick start's width makes an 88% embedding: said where the model is described
    proc = run(["--max_iters=1", "--vocab_size=4096", "--document_mask=True", "--dropout=0.0"], tmp_path / "run")
    model_line = next(line for line in proc.stdout.splitlines() if line.startswith("model:"))
    assert "packed documents masked (document_mask)" in model_line
    assert "note: the embedding is 8" in proc.stdout and "4,096 tokens x 32" in proc.stdout
    plain = run(["--max_iters=1"], tmp_path / "plain")
    assert "note: the embedding" not in plain.stdout and "document_mask" not in plain.stdout
