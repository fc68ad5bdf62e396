"""parallelism=fsdp: FSDP2 training on CPU (gloo) equals one process, sharded checkpoints resume exactly (also on
another number of processes), survive a kill mid-save, and load in one process for sampling and evaluation."""

import json
import random
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


@pytest.mark.e2e
def test_two_sharded_processes_match_one_process(tmp_path):
    train(tmp_path / "single", "--max_iters=20")  # parallelism=ddp, one process: the plain run
    train(tmp_path / "fsdp", "--max_iters=20", "--parallelism=fsdp", processes=2)
    for key in ("train_loss", "val_loss"):
        assert_losses_close(metrics(tmp_path / "single", key), metrics(tmp_path / "fsdp", key), 1e-5, key)
    assert len(metrics(tmp_path / "fsdp")) == 20
    assert json.load(open(tmp_path / "fsdp" / "config.json"))["train"]["parallelism"] == "fsdp"
    # the checkpoint is a folder of both processes' shards
    shards = sorted(p.name for p in (tmp_path / "fsdp" / "ckpt_last").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"] and not (tmp_path / "fsdp" / "ckpt_last.pt").exists()
    assert load_sharded_meta(tmp_path / "fsdp" / "ckpt_last")["step"] == 20

    # sample.py and python -m eval read the sharded folder in one process: the weights are the whole model's
    model, cfg, meta = load_model(tmp_path / "fsdp", "last")
    reference, _, _ = load_model(tmp_path / "single", "last")
    assert cfg.train.parallelism == "fsdp" and meta["step"] == 20
    for (name, value), (_, expected) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.allclose(value, expected, atol=1e-5), name
    sample = run_in_process(["sample.py"], f"--out_dir={tmp_path / 'fsdp'}", "--max_new_tokens=8", "--num_samples=1",
                            "--start=ab")
    assert sample.returncode == 0 and sample.stdout.strip(), sample.stderr
    evaluation = run_in_process(["-m", "eval"], f"--out_dir={tmp_path / 'fsdp'}", "--tasks=ppl", "--ckpt=last")
    assert evaluation.returncode == 0, evaluation.stderr[-2000:]
    assert "warning" not in evaluation.stderr.lower()
    assert json.load(open(tmp_path / "fsdp" / "eval" / "ppl.json"))
    from eval.lm_eval_adapter import EfficientAttentionLM  # lm-evaluation-harness's view of the same folder

    lm = EfficientAttentionLM(pretrained=str(tmp_path / "fsdp"), ckpt="last", device="cpu")
    assert lm.get_model_info()["step"] == 20


@pytest.mark.e2e
def test_resume_on_another_number_of_processes(tmp_path):
    train(tmp_path / "uninterrupted", "--max_iters=12", "--parallelism=fsdp")
    reference = metrics(tmp_path / "uninterrupted")
    for first, then in ((2, 1), (1, 2)):
        out = tmp_path / f"{first}to{then}"
        train(out, "--max_iters=6", "--ckpt_interval=3", "--parallelism=fsdp", processes=first)
        proc = train(out, "--max_iters=12", "--parallelism=fsdp", "--init_from=resume", processes=then)
        assert "resumed from" in proc.stdout
        assert f"RNG states for {first} processes, not {then}" in proc.stdout  # dropout is off: no effect
        assert_losses_close(metrics(out), reference, 1e-6, f"written by {first}, resumed on {then}")


@pytest.mark.e2e
def test_sigterm_then_resume_is_exact_under_fsdp(tmp_path):
    # two processes under torchrun, which passes SIGTERM on: both finish the step and save their shards
    args = ["--max_iters=12", "--parallelism=fsdp", "--n_embd=256", "--n_layer=4"]  # slow enough to interrupt
    train(tmp_path / "ref", *args, processes=2)
    out = tmp_path / "run"
    returncode, stdout, stderr = sigterm_after_two_steps([*SWAX, *args], out, processes=2)
    assert returncode != 0, stderr  # torchrun reports the signal it received
    stopped = load_sharded_meta(out / "ckpt_last")["step"]
    assert 2 <= stopped < 12 and f"at step {stopped}; ckpt_last saved" in stdout
    train(out, *args, "--init_from=resume", processes=2)
    assert metrics(out) == metrics(tmp_path / "ref")  # exact


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
    # runtime/parallelize.py: checkpoint wrapper, then each block compiled, then fully_shard per block and the root
    train(tmp_path / "plain", "--max_iters=4")
    train(tmp_path / "fsdp", "--max_iters=4", "--parallelism=fsdp", "--compile=True",
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
