"""A run folder belongs to one run, and no number is printed from inputs that do not fit it: the tokenizer of the
data against the checkpoint's (eval, resume, sample, the lm-eval adapter, compare), settings that would silently
mean full attention, the learning-rate schedule, one writer per folder, nothing overwritten or lost, and one-line
errors instead of tracebacks on bad folders and full disks."""

import json
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, load_script, read_metrics, train_subprocess
from data.embedded import documents
from data.prepare import prepare

TINY = ["configs/quickstart.py", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4",
        "--eval_iters=2", "--log_interval=1", "--warmup_iters=2"]


def run(command, *args, timeout=300):
    return subprocess.run([sys.executable, *command, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """Text, two different BPE tokenizer.json files (300 tokens each) and data prepared with the first."""
    root = tmp_path_factory.mktemp("bpe")
    text = "\n\n".join(documents(40, seed=0))
    (root / "corpus.txt").write_text(text)
    make = load_script("gpu_check").train_byte_bpe_tokenizer
    (root / "a").mkdir()
    (root / "b").mkdir()
    make(text, root / "a" / "tokenizer.json")
    make(text.upper(), root / "b" / "tokenizer.json")  # the same size, other tokens
    prepare(str(root / "corpus.txt"), tokenizer=str(root / "a" / "tokenizer.json"), out_dir=str(root / "data_a"),
            val_fraction=0.2, num_proc=1, quiet=True)
    return root


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory):
    """A tiny run trained on the embedded corpus (byte tokenizer), with checkpoints at steps 4 and 8."""
    out = tmp_path_factory.mktemp("byte_run") / "run"
    train_subprocess([*TINY, f"--out_dir={out}", "--max_iters=8", "--eval_interval=4"])
    return out


def test_eval_on_another_tokenizers_data_refuses_and_writes_nothing(byte_run, bpe):
    before = (byte_run / "eval").exists()
    proc = run(["-m", "eval"], f"--out_dir={byte_run}", f"--data_dir={bpe / 'data_a'}", "--limit=2", "--progress=False")
    assert proc.returncode != 0
    assert "was prepared with the tokenizer" in proc.stderr and "'byte'" in proc.stderr
    assert "--tokenizer=byte" in proc.stderr and "Traceback" not in proc.stderr
    assert (byte_run / "eval").exists() == before and not (byte_run / "eval" / "ppl.json").exists()


def test_resume_on_another_tokenizers_data_refuses(byte_run, bpe, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(byte_run, run_dir)
    checkpoint = (run_dir / "ckpt_last.pt").read_bytes()
    proc = train_subprocess([*TINY, f"--out_dir={run_dir}", "--max_iters=12", "--eval_interval=4",
                             "--init_from=resume", f"--data_dir={bpe / 'data_a'}", "--vocab_size=320"], check=False)
    assert proc.returncode == 2 and "cannot resume:" in proc.stderr and "tokenizer" in proc.stderr, proc.stderr
    assert (run_dir / "ckpt_last.pt").read_bytes() == checkpoint  # nothing relabelled
    assert max(read_metrics(run_dir)) == 8


def test_sample_and_lm_eval_refuse_a_tokenizer_file_that_changed_under_its_name(bpe, tmp_path):
    tokenizer = tmp_path / "tok" / "tokenizer.json"
    tokenizer.parent.mkdir()
    shutil.copy(bpe / "a" / "tokenizer.json", tokenizer)
    data = tmp_path / "data"
    prepare(str(bpe / "corpus.txt"), tokenizer=str(tokenizer), out_dir=str(data), val_fraction=0.2, num_proc=1,
            quiet=True)
    out = tmp_path / "run"
    train_subprocess([*TINY, f"--out_dir={out}", "--max_iters=2", "--eval_interval=2", f"--data_dir={data}"])
    assert run(["sample.py"], f"--out_dir={out}", "--max_new_tokens=4", "--num_samples=1").returncode == 0
    shutil.copy(bpe / "b" / "tokenizer.json", tokenizer)  # the same path and size, another vocabulary
    proc = run(["sample.py"], f"--out_dir={out}", "--max_new_tokens=4", "--num_samples=1")
    assert proc.returncode == 1 and "has another vocabulary than the one" in proc.stderr, proc.stderr
    from checkpoint import CheckpointError
    from eval.lm_eval_adapter import CheckpointLM

    with pytest.raises(CheckpointError, match="another vocabulary"):
        CheckpointLM(out_dir=str(out))


def test_compare_refuses_an_evaluation_of_another_tokenizers_data(byte_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(byte_run, run_dir)
    proc = run(["-m", "eval"], f"--out_dir={run_dir}", "--limit=2", "--progress=False")
    assert proc.returncode == 0, proc.stderr
    assert run(["scripts/compare.py", str(run_dir)]).returncode == 0
    report = json.loads((run_dir / "eval" / "ppl.json").read_text())
    assert report["provenance"]["data_tokenizer"]["tokenizer"] == "byte"
    report["provenance"]["data_tokenizer"] = {"tokenizer": "gpt2", "vocab_size": 50257, "eot_id": 50256}
    (run_dir / "eval" / "ppl.json").write_text(json.dumps(report))
    proc = run(["scripts/compare.py", str(run_dir)])
    assert proc.returncode == 2 and "'gpt2'" in proc.stderr and "re-run python -m eval" in proc.stderr, proc.stderr


@pytest.mark.parametrize("settings, message", [
    ({"attn_pattern": "swa", "swa_window": 1000}, "swa_window=1000 exceeds block_size=256"),
    ({"attn_pattern": "sa", "swa_window": 300}, "swa_window=300 exceeds block_size=256"),
    ({"attn_pattern": "swat", "swa_window": 257}, "swa_window=257 exceeds block_size=256"),
    ({"attn_pattern": "block", "block_len": 512}, "block_len=512 exceeds block_size=256"),
    ({"attn_pattern": "pbb", "block_len": 512, "bridge_width": 64}, "block_len=512 exceeds block_size=256"),
    ({"attn_pattern": "moba", "moba_block": 300}, "moba_block=300 exceeds block_size=256"),
    ({"attn_pattern": "swa,,swa,full"}, "has an empty entry"),
])
def test_settings_that_would_silently_train_full_attention_are_refused(settings, message):
    from config import ConfigError, Config, validate

    cfg = Config()
    cfg.model.block_size, cfg.model.n_layer = 256, 4
    for key, value in settings.items():
        setattr(cfg.model, key, value)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)
    cfg.model.attn_pattern = settings["attn_pattern"].replace(",,", ",swa,")
    cfg.model.swa_window = cfg.model.block_len = cfg.model.moba_block = 256  # the training length itself: allowed
    cfg.model.bridge_width = 64  # (paper 001's vanilla models train so and evaluate with the window)
    validate(cfg)


def test_the_learning_rate_decays_over_max_iters_unless_told_otherwise():
    from config import load_config
    from train import get_lr, schedule_warning

    # the README's own-text recipe: the quickstart config with --max_iters=2000
    t = load_config(["configs/quickstart.py", "--max_iters=2000"]).train
    assert get_lr(1500, t) > t.min_lr * 1.5 and get_lr(1999, t) < t.min_lr * 1.01 and not schedule_warning(t)
    t = load_config(["configs/quickstart.py", "--max_iters=400"]).train
    assert get_lr(399, t) < t.min_lr * 1.01  # a shorter run decays fully too
    t = load_config(["configs/quickstart.py", "--max_iters=2000", "--lr_decay_iters=800"]).train
    assert get_lr(1500, t) == t.min_lr and "stays there for the last 60% of training" in schedule_warning(t)
    assert "before min_lr" in schedule_warning(load_config(["configs/quickstart.py", "--lr_decay_iters=4000"]).train)


def test_ppl_windows_on_a_model_without_windows_is_refused(byte_run):
    proc = run(["-m", "eval"], f"--out_dir={byte_run}", "--ppl_windows=8,16", "--limit=1", "--progress=False")
    assert proc.returncode == 2 and "no layer of this model (full) reads swa_window" in proc.stderr, proc.stderr


def test_eval_results_keep_every_setting_and_compare_marks_limited_ones(byte_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(byte_run, run_dir)
    full = ["-m", "eval", f"--out_dir={run_dir}", "--progress=False", "--ppl_max_tokens=3000"]
    assert run(full, "--ppl_lengths=32").returncode == 0
    assert run(full, "--ppl_lengths=16").returncode == 0  # another length: added, the first kept
    assert run(full, "--ppl_lengths=32", "--limit=3").returncode == 0  # a quick check beside the full result
    report = json.loads((run_dir / "eval" / "ppl.json").read_text())
    rows = report["results"]["rows"]
    limits = {report["settings"][r["setting"]]["limit"]: r for r in rows if r["length"] == 32}
    assert sorted((r["length"], report["settings"][r["setting"]]["limit"]) for r in rows) == [(16, 0), (32, 0), (32, 3)]
    assert limits[3]["windows"] == 3 and limits[0]["windows"] > 3
    assert run(full, "--ppl_lengths=32").returncode == 0  # recomputed: replaces its own cell only
    assert len(json.loads((run_dir / "eval" / "ppl.json").read_text())["results"]["rows"]) == 3
    proc = run(["scripts/compare.py", str(run_dir)])
    assert proc.returncode == 0, proc.stderr
    assert "ppl@L=32 (limit 3)" in proc.stdout and "ppl@L=32 " in proc.stdout.replace("ppl@L=32 (", "")
    assert "limit=3" in (run_dir / "eval" / "summary.md").read_text()
