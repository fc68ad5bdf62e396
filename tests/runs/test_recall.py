"""The recall corpus and task: the answer lies beyond a small sliding-window model's reach, training can count
only the answers (loss_after), and the recall evaluation scores fresh documents."""

import json

import numpy as np
import pytest
import torch

from conftest import run_in_process, train_in_process
from data.loader import WindowSampler
from data.prepare import prepare
from data.recall import ANSWER, VALUES, document_parts
from data.tokenizer import ByteTokenizer
from eval.recall import contexts


def test_documents_put_the_value_beyond_four_window_16_layers():
    for index in range(300):
        context, answer = document_parts(0, index)
        assert context.endswith(ANSWER) and answer in VALUES
        stated = context.index("=") + 1  # "#k=V|...": the value follows the first '='
        assert context[stated] == answer
        assert len(context) - stated > 4 * 15  # the answer's prediction sits beyond 4 layers x (w - 1)
        assert context.count(ANSWER) == 1


def test_loss_after_keeps_only_the_answers(tmp_path):
    prepare("recall", "byte", out_dir=str(tmp_path), quiet=True)
    marker = ByteTokenizer().encode(ANSWER)[0]
    plain = WindowSampler(str(tmp_path), "train", 128, 8, 1)
    masked = WindowSampler(str(tmp_path), "train", 128, 8, 1, loss_after=marker)
    (x, y), (x2, y2) = plain.get(0, 0), masked.get(0, 0)
    assert torch.equal(x, x2)
    counted = y2 >= 0
    assert counted.any() and torch.equal(counted, x == marker)
    assert torch.equal(y2[counted], y[counted])
    letters = set(ByteTokenizer().encode("".join(VALUES)))
    assert set(y2[counted].tolist()) <= letters


def train(out, *args):
    return train_in_process(["configs/sa/sa_small_swa.py", f"--out_dir={out}", "--n_layer=2", "--n_embd=32",
                             "--max_iters=4", "--eval_interval=4", "--eval_iters=2", "--batch_size=4", *args],
                            check=False)


def final_val_loss(out):
    return [json.loads(line)["val_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if "val_loss" in line][-1]


@pytest.mark.e2e
def test_training_on_answers_only_and_a_marker_that_is_not_one_token(tmp_path):
    steps = ["--max_iters=100", "--warmup_iters=10", "--eval_interval=100"]
    for name, marker in (("answers", ">"), ("all", "")):
        proc = train(tmp_path / name, *steps, f"--loss_after={marker}")
        assert proc.returncode == 0, proc.stderr[-3000:]
    # SWA cannot reach the value, so the answers stay near log(26) = 3.26; all targets include the counting
    # filler, which a few steps learn
    assert final_val_loss(tmp_path / "answers") > 3.0
    assert final_val_loss(tmp_path / "all") < 1.5
    bad = train(tmp_path / "bad", "--loss_after=>>")
    assert bad.returncode == 2 and "exactly one token" in bad.stderr
    absent = train(tmp_path / "absent", "--loss_after=@")
    assert absent.returncode == 2 and "never occurs" in absent.stderr


def test_recall_contexts_have_the_length_and_end_at_the_marker():
    tok = ByteTokenizer()
    examples = contexts(tok, tok.eot_id, 128, 20, seed=0)
    for ids, answer in examples:
        assert len(ids) == 128 and ids[-1] == tok.encode(ANSWER)[0] and answer in VALUES
    assert len({a for _, a in examples}) > 5
    np.testing.assert_equal(examples[0][0], contexts(tok, tok.eot_id, 128, 20, seed=0)[0][0])  # seeded


@pytest.mark.e2e
@pytest.mark.parametrize("pattern", ["swa"])
def test_recall_eval_task_runs_on_a_trained_checkpoint(tmp_path, pattern):
    out = tmp_path / "run"
    assert train(out).returncode == 0
    proc = run_in_process(["-m", "eval"], f"--out_dir={out}", "--progress=False", "--tasks=recall",
                          "--recall_samples=30")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "eval" / "recall.json").read_text())
    rows = report["results"]["rows"]
    assert rows[0]["n"] == 30 and 0 <= rows[0]["accuracy"] <= 1 and len(rows[0]["correct"]) == 30
    # per-example results, pairable across runs (scripts/compare.py --paired)
    assert [x["id"] for x in report["per_example"]] == [f"L128/{i}" for i in range(30)]
    assert [x["correct"] for x in report["per_example"]] == rows[0]["correct"]


@pytest.mark.e2e
def test_recall_at_longer_distances_and_another_test_window(tmp_path):
    out = tmp_path / "run"
    assert train(out, "--attn_pattern=swa", "--swa_window=16").returncode == 0
    proc = run_in_process(["-m", "eval"], f"--out_dir={out}", "--progress=False", "--tasks=recall",
                          "--recall_samples=10", "--recall_filler=60:80,200:220,400:480", "--recall_lengths=256",
                          "--window=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "400:480 L=256: skipped" in proc.stdout  # a document that long does not fit in 256 tokens
    report = json.loads((out / "eval" / "recall.json").read_text())
    assert [row["filler"] for row in report["results"]["rows"]] == ["60:80", "200:220"]
    assert report["per_example"][10]["id"] == "F200:220/L256/0" and report["per_example"][10]["cell"] == "F200:220/L256"
    assert report["provenance"]["eval_config"]["window"] == 8
    # the documents asked at 200-220 really hold their value that far back
    ctx = contexts(ByteTokenizer(), 256, 256, 3, seed=0, min_filler=200, max_filler=220)
    for ids, _ in ctx:
        ids = list(ids)
        text = bytes(ids[len(ids) - ids[::-1].index(256):]).decode()  # the last document (after end-of-text)
        assert text.endswith(ANSWER) and text.rindex("=") < len(text) - 200
    bad = run_in_process(["-m", "eval"], f"--out_dir={out}", "--tasks=recall", "--recall_filler=9:1")
    assert bad.returncode == 2 and "recall_filler" in bad.stderr
