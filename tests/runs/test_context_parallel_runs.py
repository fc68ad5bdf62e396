"""train.py with --context_parallel: each sequence cut over the processes of a torchrun group trains as one process
does, step for step, and a run resumes under another number of shards; what context parallelism cannot serve is
refused in one line before any data is read."""

import json
import shutil
import subprocess
import types

import pytest
import torch

from conftest import REPO, launcher, read_metrics, run_in_process, train_in_process, train_subprocess

# swa and mLSTM layers with packed documents: a window's halo, the recurrence's state and the documents' cuts all
# cross the shards' boundary (block_size 64: shards of 32 tokens, a window of 16)
SMALL = ["configs/quickstart.py", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=64", "--batch_size=4",
         "--eval_iters=2", "--eval_interval=4", "--log_interval=1", "--warmup_iters=2", "--lr_decay_iters=8",
         "--dropout=0.0", "--attn_pattern=swax", "--swa_window=16", "--document_mask=True"]
TOLERANCE = 1e-5


def losses(out_dir) -> dict:
    return {(key, step): value for key in ("train_loss", "val_loss")
            for step, value in read_metrics(out_dir, key).items()}


def assert_same_losses(whole, sharded, at_least: int) -> None:
    """Every train and validation loss the sharded run logged equals the one-process run's, at every step."""
    expected, got = losses(whole), losses(sharded)
    assert set(got) == set(expected) and len(expected) >= at_least
    for key, value in expected.items():
        assert abs(got[key] - value) <= TOLERANCE * abs(value), (key, got[key], value)


@pytest.mark.e2e
def test_two_shards_train_as_one_process_and_resume_under_one(tmp_path):
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    train_in_process([*SMALL, "--max_iters=8", f"--out_dir={whole}"])
    proc = train_subprocess([*SMALL, "--max_iters=4", f"--out_dir={sharded}", "--context_parallel=2"], processes=2)
    assert "each sequence cut into 2 shards of 32 tokens" in proc.stdout
    # what each layer exchanges, said once at start-up: a window of 16 receives 15 positions
    assert "swa layers: 15 positions' keys and values" in proc.stdout
    assert "mlstm layers: one state summary per head from each other process" in proc.stdout
    # and the run goes on in one process from the sharded run's checkpoint
    train_in_process([*SMALL, "--max_iters=8", f"--out_dir={sharded}", "--init_from=resume"])
    assert_same_losses(whole, sharded, at_least=10)


@pytest.mark.e2e
def test_the_quick_starts_full_attention_over_two_shards_trains_as_one_process(tmp_path):
    # the quick start's own pattern (full): every earlier key travels, and the losses are one process's
    small = [a for a in SMALL if not a.startswith(("--attn_pattern", "--swa_window", "--document_mask"))]
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    train_in_process([*small, "--max_iters=4", f"--out_dir={whole}"])
    proc = train_subprocess([*small, "--max_iters=4", f"--out_dir={sharded}", "--context_parallel=2"], processes=2)
    assert "full layers: 32 positions' keys and values" in proc.stdout
    assert "every position of the other shards" in proc.stdout
    assert_same_losses(whole, sharded, at_least=5)


@pytest.mark.e2e
def test_fsdp_over_two_groups_of_two_shards_with_checkpointing_trains_as_one_process(tmp_path):
    # dp 2 x cp 2 on 4 processes: FSDP2 shards the parameters over all four, each sequence is cut over a pair,
    # and each block recomputes its forward, exchanges included, in backward (selective checkpointing)
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    batch = ["--batch_size=2", "--gradient_accumulation_steps=2", "--max_iters=4"]
    train_in_process([*SMALL, *batch, f"--out_dir={whole}"])
    train_subprocess([*SMALL, *batch, f"--out_dir={sharded}", "--context_parallel=2", "--parallelism=fsdp",
                      "--activation_checkpointing=selective"], processes=4)
    assert_same_losses(whole, sharded, at_least=5)


@pytest.mark.e2e
def test_eval_scores_each_window_over_two_processes_as_one_process_does(tmp_path):
    # perplexity at the trained length and beyond it (RoPE), a length the shards cut unevenly (padded): the
    # same numbers, each window's too, from the group's first process alone
    run = tmp_path / "run"
    train_in_process([*SMALL, "--arch=llama", "--max_iters=2", f"--out_dir={run}"])
    shutil.copytree(run, tmp_path / "copy")
    ppl = ["-m", "eval", "--tasks=ppl", "--ppl_lengths=64,151", "--ppl_max_tokens=2000"]
    one = run_in_process(ppl[:2], *ppl[2:], f"--out_dir={run}")
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([*launcher(2), *ppl, f"--out_dir={tmp_path / 'copy'}", "--context_parallel=2"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-2000:]
    assert two.stdout.count("ppl  L=") == 2 and "ppl  L=151" in two.stdout  # printed once, by the first process
    expected, got = (json.loads((folder / "eval" / "ppl.json").read_text()) for folder in (run, tmp_path / "copy"))
    rows = lambda result: {r["length"]: r["nll"] for r in result["results"]["rows"]}  # noqa: E731
    examples = lambda result: [x["nll"] for x in result["per_example"]]  # noqa: E731
    assert rows(got).keys() == rows(expected).keys() == {64, 151}
    for length, nll in rows(expected).items():
        assert abs(rows(got)[length] - nll) <= TOLERANCE * nll, (length, rows(got)[length], nll)
    assert max(abs(a - b) / b for a, b in zip(examples(got), examples(expected))) <= TOLERANCE


@pytest.mark.parametrize("args, said", [
    (["--context_parallel=3"], "block_size=64 does not cut into 3 equal shards"),
    (["--context_parallel=2", "--cuda_graphs=True"], "context_parallel=2 with cuda_graphs=True: not supported yet"),
    (["--context_parallel=2"], "start them with torchrun"),
])
def test_what_context_parallelism_cannot_serve_is_refused_before_the_data(tmp_path, args, said):
    proc = run_in_process(["train.py"], *SMALL, f"--out_dir={tmp_path / 'run'}", "--data_dir=/nonexistent", *args)
    assert proc.returncode == 2 and said in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_a_mixer_that_declares_no_context_parallel_form_is_refused_before_the_data(tmp_path, monkeypatch):
    from attention.stochastic import StochasticAttention

    monkeypatch.setattr(StochasticAttention, "context_parallel", False)  # as a mixer that does not declare it
    proc = run_in_process(["train.py"], *SMALL, f"--out_dir={tmp_path / 'run'}", "--data_dir=/nonexistent",
                          "--context_parallel=2", "--attn_pattern=sa")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "the sa layers have no context-parallel form" in proc.stderr.strip().splitlines()[-1]


def test_processes_that_do_not_divide_into_groups_are_refused(capsys):
    from training.setup import context_parallel_shard

    with pytest.raises(SystemExit) as exit_:
        context_parallel_shard(types.SimpleNamespace(context_parallel=2), True, 3, torch.device("cpu"), 64)
    assert exit_.value.code == 2 and "with 3 processes" in capsys.readouterr().err
