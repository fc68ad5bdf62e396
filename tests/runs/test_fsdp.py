"""parallelism=fsdp: FSDP2 training on CPU (gloo) equals one process, sharded checkpoints resume exactly (also on
another number of processes), survive a kill mid-save, and load in one process for sampling and evaluation."""

import json
import random
import shutil
import subprocess
import sys
import time

import pytest
import torch

from runtime.checkpoint import load_model, load_sharded_meta, remove_stale_temp_files, sharded_checkpoint_path
from conftest import REPO, read_metrics, run_in_process, sigterm_after_two_steps, train_in_process, train_subprocess
from helpers import assert_losses_close

# a small llama with swa and mlstm layers (swax), dropout off: runs on 1 and 2 processes must agree
SWAX = ["configs/quickstart.py", "--arch=llama", "--bias=False", "--attn_pattern=swax", "--swa_window=8",
        "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=2",
        "--gradient_accumulation_steps=4", "--eval_iters=3", "--log_interval=1", "--warmup_iters=2",
        "--lr_decay_iters=20", "--dropout=0.0", "--eval_interval=5"]


def train(out_dir, *args, processes=1, check=True):
    """One process in this process (a process group of one under FSDP), several under torchrun."""
    if processes == 1:
        return train_in_process([*SWAX, f"--out_dir={out_dir}", *args], check)
    return train_subprocess([*SWAX, f"--out_dir={out_dir}", *args], 300, check, processes)


metrics = read_metrics


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """Two sharded processes under torchrun, which passes SIGTERM on: both finish the step and save their shards.
    Stopped whenever the signal lands, well before its max_iters (however slowly this machine runs): (the run
    folder, returncode, stdout, stderr). Tests resume copies of the folder."""
    out = tmp_path_factory.mktemp("fsdp_interrupted") / "run"
    return (out, *sigterm_after_two_steps([*SWAX, "--max_iters=1000", "--parallelism=fsdp"], out, processes=2))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, interrupted):
    """Uninterrupted runs to a few steps past the interrupted run's checkpoint (the learning rate follows
    lr_decay_iters, not max_iters), each run once for every test that compares with it: one plain process
    (parallelism=ddp), one process under FSDP (a process group of one) and two sharded processes."""
    root = tmp_path_factory.mktemp("fsdp_runs")
    steps = max(12, load_sharded_meta(interrupted[0] / "ckpt_last")["step"] + 6)
    train(root / "single", f"--max_iters={steps}")
    train(root / "fsdp1", f"--max_iters={steps}", "--parallelism=fsdp")
    train(root / "fsdp2", f"--max_iters={steps}", "--parallelism=fsdp", processes=2)
    return root, steps


@pytest.mark.e2e
def test_two_sharded_processes_match_one_process(runs):
    runs, steps = runs
    for key in ("train_loss", "val_loss"):
        assert_losses_close(metrics(runs / "single", key), metrics(runs / "fsdp2", key), 1e-5, key)
    assert len(metrics(runs / "fsdp2")) == steps
    assert json.load(open(runs / "fsdp2" / "config.json"))["train"]["parallelism"] == "fsdp"
    # the checkpoint is a folder of both processes' shards
    shards = sorted(p.name for p in (runs / "fsdp2" / "ckpt_last").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"] and not (runs / "fsdp2" / "ckpt_last.pt").exists()
    assert load_sharded_meta(runs / "fsdp2" / "ckpt_last")["step"] == steps

    # sample.py and python -m eval read the sharded folder in one process: the weights are the whole model's
    model, cfg, meta = load_model(runs / "fsdp2", "last")
    reference, _, _ = load_model(runs / "single", "last")
    assert cfg.train.parallelism == "fsdp" and meta["step"] == steps
    for (name, value), (_, expected) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.allclose(value, expected, atol=1e-5), name
    sample = run_in_process(["sample.py"], f"--out_dir={runs / 'fsdp2'}", "--max_new_tokens=8", "--num_samples=1",
                            "--start=ab")
    assert sample.returncode == 0 and sample.stdout.strip(), sample.stderr
    evaluation = run_in_process(["-m", "eval"], f"--out_dir={runs / 'fsdp2'}", "--tasks=ppl", "--ckpt=last")
    assert evaluation.returncode == 0, evaluation.stderr[-2000:]
    assert "warning" not in evaluation.stderr.lower()
    assert json.load(open(runs / "fsdp2" / "eval" / "ppl.json"))
    from eval.lm_eval_adapter import EfficientAttentionLM  # lm-evaluation-harness's view of the same folder

    lm = EfficientAttentionLM(pretrained=str(runs / "fsdp2"), ckpt="last", device="cpu")
    assert lm.get_model_info()["step"] == steps


@pytest.mark.e2e
def test_resume_on_another_number_of_processes(runs, interrupted, tmp_path):
    runs, steps = runs
    reference = metrics(runs / "fsdp1")
    written_by_two = shutil.copytree(interrupted[0], tmp_path / "2to1")  # shards of two processes
    written_by_one = tmp_path / "1to2"
    train(written_by_one, "--max_iters=6", "--ckpt_interval=3", "--parallelism=fsdp")
    for out, first, then in ((written_by_two, 2, 1), (written_by_one, 1, 2)):
        proc = train(out, f"--max_iters={steps}", "--parallelism=fsdp", "--init_from=resume", processes=then)
        assert "resumed from" in proc.stdout
        assert f"RNG states for {first} processes, not {then}" in proc.stdout  # dropout is off: no effect
        assert_losses_close(metrics(out), reference, 1e-6, f"written by {first}, resumed on {then}")


@pytest.mark.e2e
def test_sigterm_then_resume_is_exact_under_fsdp(runs, interrupted, tmp_path):
    runs, steps = runs
    run, returncode, stdout, stderr = interrupted
    assert returncode != 0, stderr  # torchrun reports the signal it received
    stopped = load_sharded_meta(run / "ckpt_last")["step"]
    assert 2 <= stopped < steps and f"at step {stopped}; ckpt_last saved" in stdout
    out = shutil.copytree(run, tmp_path / "run")
    train(out, f"--max_iters={steps}", "--parallelism=fsdp", "--init_from=resume", processes=2)
    assert metrics(out) == metrics(runs / "fsdp2")  # exact


@pytest.mark.e2e
def test_sigkill_while_saving_shards_keeps_the_last_checkpoint(tmp_path):
    cmd = [sys.executable, "train.py", *SWAX, f"--out_dir={tmp_path}", "--max_iters=1000", "--ckpt_interval=1",
           "--parallelism=fsdp", "--n_embd=256", "--n_layer=4"]  # shards of ~40 MB with AdamW, after every step
    rng = random.Random(0)
    for attempt in range(2):
        proc = subprocess.Popen(cmd + (["--init_from=resume"] if attempt else []), cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        start = time.time()
        while sharded_checkpoint_path(tmp_path / "ckpt_last") is None or time.time() - start < 5 + 2 * attempt:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.01)
        time.sleep(rng.random() * 0.3)
        proc.kill()
        proc.wait()
        # the previous complete checkpoint, whatever the kill interrupted: its meta and all of its shards
        model, _, meta = load_model(tmp_path, "last")
        assert meta["step"] >= 1


def test_a_kill_between_the_renames_leaves_the_previous_checkpoint_in_use(tmp_path):
    folder = tmp_path / "ckpt_last"
    folder.mkdir()
    torch.save({"step": 3}, folder / "meta.pt")
    # killed after moving the previous checkpoint aside and before the new one took its place
    folder.rename(tmp_path / ".old.ckpt_last")
    (tmp_path / ".tmp.ckpt_last").mkdir()
    (tmp_path / ".tmp.ckpt_last" / "__0_0.distcp").write_bytes(b"partial")
    assert sharded_checkpoint_path(folder) == tmp_path / ".old.ckpt_last"
    assert load_sharded_meta(folder)["step"] == 3
    remove_stale_temp_files(tmp_path)  # what train.py does before it writes anything
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_last"]
    assert sharded_checkpoint_path(folder) == folder


@pytest.mark.e2e
def test_fsdp_refuses_float16_before_writing_anything(tmp_path):
    proc = train(tmp_path / "run", "--parallelism=fsdp", "--dtype=float16", "--max_iters=2", check=False)
    assert proc.returncode == 2 and "bfloat16" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_sharding_composes_with_compiled_blocks_and_activation_checkpointing(tmp_path):
    # runtime/parallelize.py: checkpoint wrapper, then each block compiled, then fully_shard per block and the root.
    # swa layers alone: the layout is what is checked, and compiling mlstm's chunk loop would double the time (swa +
    # mLSTM under FSDP2, checkpointing and compiled blocks together: test_gpu_sim's run of the GPU check's settings)
    train(tmp_path / "plain", "--max_iters=4", "--attn_pattern=swa")
    train(tmp_path / "fsdp", "--max_iters=4", "--attn_pattern=swa", "--parallelism=fsdp", "--compile=True",
          "--activation_checkpointing=selective", "--fsdp_reshard_after_forward=False")  # a group of one process
    for key in ("train_loss", "val_loss"):
        assert_losses_close(metrics(tmp_path / "plain", key), metrics(tmp_path / "fsdp", key), 1e-5, key)


@pytest.mark.e2e
def test_two_nodes_of_one_process_each(tmp_path):
    # torchrun's multi-node rendezvous on this machine: two agents, each a "node" whose one process has
    # LOCAL_RANK 0; only global rank 0 may print and write the run's files
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    train(tmp_path / "plain", "--max_iters=4")
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=two_nodes", "train.py", *SWAX,
               f"--out_dir={tmp_path / 'run'}", "--max_iters=4", "--parallelism=fsdp"]
    nodes = [subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert all(node.returncode == 0 for node in nodes), [err[-2000:] for _, err in outputs]
    assert sorted("done: best val loss" in out for out, _ in outputs) == [False, True]
    for key in ("train_loss", "val_loss"):
        assert_losses_close(metrics(tmp_path / "plain", key), metrics(tmp_path / "run", key), 1e-5, key)
    assert json.load(open(tmp_path / "run" / "config.json"))["run"]["world_size"] == 2
    assert sorted(p.name for p in (tmp_path / "run" / "ckpt_last").glob("*.distcp")) == ["__0_0.distcp",
                                                                                         "__1_0.distcp"]
