"""document_mask in training runs: saved with the run and its checkpoints, takes its end-of-text token from the
data, and resumed, DDP and FSDP runs give the metrics of one uninterrupted process."""

import json

import pytest

from conftest import read_metrics, run_in_process, train_in_process, train_subprocess
from helpers import assert_losses_close
from runtime.checkpoint import load_checkpoint

# swa and mlstm layers (swax): a windowed kernel and a recurrent state, both stopped at every end-of-text token
SWAX = ["configs/quickstart.py", "--arch=llama", "--bias=False", "--attn_pattern=swax", "--swa_window=8",
        "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=64", "--batch_size=2",
        "--gradient_accumulation_steps=2", "--eval_iters=2", "--log_interval=1", "--warmup_iters=2",
        "--lr_decay_iters=12", "--dropout=0.0", "--eval_interval=4"]


def train(out_dir, *args, processes=1):
    if processes == 1:
        return train_in_process([*SWAX, f"--out_dir={out_dir}", *args])
    return train_subprocess([*SWAX, f"--out_dir={out_dir}", *args], 300, True, processes)


@pytest.mark.e2e
def test_document_mask_is_saved_and_resumed_ddp_and_fsdp_runs_match_one_process(tmp_path):
    train(tmp_path / "plain", "--max_iters=12")
    train(tmp_path / "docs", "--max_iters=12", "--document_mask=True")
    reference = read_metrics(tmp_path / "docs")
    assert reference != read_metrics(tmp_path / "plain")  # the mask is in effect (the embedded corpus is packed)
    saved = json.load(open(tmp_path / "docs" / "config.json"))["model"]
    assert saved["document_mask"] is True and saved["eot_id"] == 256  # the byte tokenizer's, from meta.json
    assert load_checkpoint(tmp_path / "docs" / "ckpt_last.pt")["config"]["model"]["document_mask"] is True

    resumed = tmp_path / "resumed"
    train(resumed, "--max_iters=6", "--ckpt_interval=3", "--document_mask=True")
    train(resumed, "--max_iters=12", "--init_from=resume", "--document_mask=True")
    assert read_metrics(resumed) == reference

    train(tmp_path / "ddp", "--max_iters=12", "--document_mask=True", processes=2)
    assert_losses_close(read_metrics(tmp_path / "ddp"), reference, 1e-5, "ddp")
    train(tmp_path / "fsdp", "--max_iters=12", "--document_mask=True", "--parallelism=fsdp", processes=2)
    assert_losses_close(read_metrics(tmp_path / "fsdp"), reference, 1e-5, "fsdp")


@pytest.mark.e2e
def test_an_end_of_text_token_other_than_the_datas_is_refused(tmp_path):
    proc = train_in_process([*SWAX, f"--out_dir={tmp_path}", "--max_iters=1", "--document_mask=True", "--eot_id=10"],
                            check=False)
    assert proc.returncode == 2 and "eot_id=10 but the end-of-text token" in proc.stderr, proc.stderr
    assert not list(tmp_path.glob("ckpt_*"))


@pytest.mark.e2e
def test_the_document_benchmark_times_each_layer_both_ways(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_in_process(["-m", "scripts.bench_documents", "--variants=swa,mlstm", "--lengths=512", "--repeats=1",
                           "--min_doc=50", "--max_doc=200", f"--json={out}"])
    assert proc.returncode == 0, proc.stderr
    results = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert results.keys() == {"swa", "mlstm"} and results["swa"]["kernel"] == "chunked"
    assert all(r["documents"] > 2 and r["with_ms"] > 0 and r["without_ms"] > 0 for r in results.values())
    assert "| swa | 512 | chunked |" in proc.stdout
