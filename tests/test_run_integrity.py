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
from gpucheck import tiny_hf
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
    make = tiny_hf.train_byte_bpe_tokenizer
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


@pytest.mark.e2e
def test_eval_on_another_tokenizers_data_refuses_and_writes_nothing(byte_run, bpe):
    before = (byte_run / "eval").exists()
    proc = run(["-m", "eval"], f"--out_dir={byte_run}", f"--data_dir={bpe / 'data_a'}", "--limit=2", "--progress=False")
    assert proc.returncode != 0
    assert "was prepared with the tokenizer" in proc.stderr and "'byte'" in proc.stderr
    assert "--tokenizer=byte" in proc.stderr and "Traceback" not in proc.stderr
    assert (byte_run / "eval").exists() == before and not (byte_run / "eval" / "ppl.json").exists()


@pytest.mark.e2e
def test_resume_on_another_tokenizers_data_refuses(byte_run, bpe, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(byte_run, run_dir)
    checkpoint = (run_dir / "ckpt_last.pt").read_bytes()
    proc = train_subprocess([*TINY, f"--out_dir={run_dir}", "--max_iters=12", "--eval_interval=4",
                             "--init_from=resume", f"--data_dir={bpe / 'data_a'}", "--vocab_size=320"], check=False)
    assert proc.returncode == 2 and "cannot resume:" in proc.stderr and "tokenizer" in proc.stderr, proc.stderr
    assert (run_dir / "ckpt_last.pt").read_bytes() == checkpoint  # nothing relabelled
    assert max(read_metrics(run_dir)) == 8


@pytest.mark.e2e
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
    from eval.lm_eval_adapter import EfficientAttentionLM

    with pytest.raises(CheckpointError, match="another vocabulary"):
        EfficientAttentionLM(pretrained=str(out), device="cpu")


@pytest.mark.e2e
def test_compare_refuses_an_evaluation_of_another_tokenizers_data(byte_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(byte_run, run_dir)
    proc = run(["-m", "eval"], f"--out_dir={run_dir}", "--limit=2", "--progress=False")
    assert proc.returncode == 0, proc.stderr
    assert run(["-m", "scripts.compare", str(run_dir)]).returncode == 0
    report = json.loads((run_dir / "eval" / "ppl.json").read_text())
    assert report["provenance"]["data_tokenizer"]["tokenizer"] == "byte"
    report["provenance"]["data_tokenizer"] = {"tokenizer": "gpt2", "vocab_size": 50257, "eot_id": 50256}
    (run_dir / "eval" / "ppl.json").write_text(json.dumps(report))
    proc = run(["-m", "scripts.compare", str(run_dir)])
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


@pytest.mark.e2e
def test_ppl_windows_on_a_model_without_windows_is_refused(byte_run):
    proc = run(["-m", "eval"], f"--out_dir={byte_run}", "--ppl_windows=8,16", "--limit=1", "--progress=False")
    assert proc.returncode == 2 and "no layer of this model (full) reads swa_window" in proc.stderr, proc.stderr


@pytest.mark.e2e
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
    proc = run(["-m", "scripts.compare", str(run_dir)])
    assert proc.returncode == 0, proc.stderr
    assert "ppl@L=32 (limit 3)" in proc.stdout and "ppl@L=32 " in proc.stdout.replace("ppl@L=32 (", "")
    assert "limit=3" in (run_dir / "eval" / "summary.md").read_text()


def evaluate(run_dir, task, result, provenance=None, **options):
    """What a call of python -m eval leaves in run_dir/eval/TASK.json, for a result computed under options."""
    import dataclasses

    from checkpoint import write_json
    from eval.__main__ import EvalRunConfig
    from eval.results import merged_report

    path = run_dir / "eval" / f"{task}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    provenance = {"ckpt": str(run_dir / "ckpt_best.pt"), "step": 8, "config_hash": "c0", **(provenance or {})}
    e = dataclasses.replace(EvalRunConfig(out_dir=str(run_dir)), **options)
    write_json(merged_report(path, task, json.loads(json.dumps(result)), e, run_dir.parent, provenance), path)
    return json.loads(path.read_text())


def recall_result(correct, length=64):
    return {"rows": [{"filler": "corpus", "length": length, "n": len(correct), "accuracy": sum(correct) / len(correct)}],
            "per_example": [{"id": f"L{length}/{i}", "cell": f"L{length}", "filler": "corpus", "length": length,
                             "correct": c} for i, c in enumerate(correct)]}


def niah_result(length, scores):
    rows = [{"kind": k, "length": length, "depth": None, "n": 1, "score": v, "acc_rank": v} for k, v in scores.items()]
    from eval.niah import average_rows

    return {"rows": rows + average_rows(rows),
            "per_example": [{"id": f"{k}/{length}/0", "kind": k, "length": length, "depth": None, "correct": bool(v)}
                            for k, v in scores.items()]}


def test_paired_runs_are_paired_under_one_setting_both_were_evaluated_under(tmp_path, monkeypatch):
    import itertools

    import eval.results

    clock = itertools.count(1000)
    monkeypatch.setattr(eval.results.time, "time", lambda: next(clock))
    from eval import compare

    # A evaluated with seed 1 then 2, B with seed 2 then 1: each file's newest setting differs, the pair must not
    a, b = tmp_path / "a", tmp_path / "b"
    evaluate(a, "recall", recall_result([True] * 8), seed=1)
    evaluate(a, "recall", recall_result([True] * 4 + [False] * 4), seed=2)
    evaluate(b, "recall", recall_result([False] * 8), seed=2)
    evaluate(b, "recall", recall_result([True] * 8), seed=1)
    records = [{"name": d.name, "source": str(d), "evals": compare.load_evals(d)} for d in (a, b)]
    out = compare.paired(*records, "recall")
    assert (out["all"]["acc_a"], out["all"]["acc_b"]) == (0.5, 0.0)  # seed 2 on both sides (evaluated most recently)


def test_a_later_evaluation_keeps_earlier_per_example_results_and_recomputes_averages(tmp_path):
    evaluate(tmp_path, "niah", niah_result(1024, {"single_1": 1.0, "multikey_1": 0.0}))
    evaluate(tmp_path, "niah", niah_result(2048, {"single_1": 1.0}))
    report = evaluate(tmp_path, "niah", niah_result(1024, {"single_1": 0.0}))  # one subtask again at 1024
    assert sorted((x["kind"], x["length"], x["correct"]) for x in report["per_example"]) == [
        ("multikey_1", 1024, False), ("single_1", 1024, False), ("single_1", 2048, True)]
    averages = [r for r in report["results"]["rows"] if r["kind"] == "average"]
    assert [(r["length"], r["score"]) for r in averages] == [(1024, 0.0)]  # from the rows as merged, not stale
    diag = {"rows": [{"probe": "needle", "cell": "all", "n": 1, "accuracy": 1.0}], "prompt_nll": [{"bin_start": 1}],
            "per_example": [{"id": "needle/0", "probe": "needle", "correct": True}]}
    evaluate(tmp_path, "diagnostics", diag)
    report = evaluate(tmp_path, "diagnostics", {**diag, "rows": [{**diag["rows"][0], "probe": "boundary_sweep"}],
                                                "prompt_nll": [], "per_example": [{"id": "b/0", "probe": "boundary_sweep",
                                                                                   "correct": False}]})
    assert report["results"]["prompt_nll"] == [{"bin_start": 1}]  # the needle's profile outlives a later probe
    assert sorted(x["probe"] for x in report["per_example"]) == ["boundary_sweep", "needle"]


def test_another_checkpoint_moves_the_earlier_results_aside_and_hf_attention_is_a_setting(tmp_path, capsys):
    evaluate(tmp_path, "recall", recall_result([True] * 4, length=32))
    # the same checkpoint named by another path (a relative --out_dir, a moved folder) is the same model
    report = evaluate(tmp_path, "recall", recall_result([True] * 4, length=48),
                      {"ckpt": f"moved/{tmp_path.name}/ckpt_best.pt"})
    assert [r["length"] for r in report["results"]["rows"]] == [32, 48]
    assert not (tmp_path / "eval" / "superseded").exists()
    report = evaluate(tmp_path, "recall", recall_result([False] * 4, length=64), {"step": 16})
    assert [r["length"] for r in report["results"]["rows"]] == [64]  # no step-8 cell read as the step-16 model's
    kept = list((tmp_path / "eval" / "superseded").glob("recall-step8-*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["results"]["rows"][0]["length"] == 32
    assert "moved to" in capsys.readouterr().err
    hf = {"ckpt": "gpt2", "step": None, "config_hash": "h"}
    evaluate(tmp_path, "recall", recall_result([True] * 4), {**hf, "attention": {"swa_window": 256}})
    report = evaluate(tmp_path, "recall", recall_result([False] * 4), {**hf, "config_hash": "h2",
                                                                      "attention": {"swa_window": 512}})
    assert len(report["settings"]) == 2 and len(report["results"]["rows"]) == 2  # side by side, not mixed
    from eval.results import describe_settings

    assert "512" in describe_settings(report["settings"])[report["results"]["rows"][1]["setting"]]


def test_the_standing_setting_has_the_plain_column_and_the_bridge_sweep_reads_it(tmp_path):
    from eval import compare

    sweep = load_script("bridge_sweep")
    evaluate(tmp_path, "recall", recall_result([True] * 4), seed=1)
    evaluate(tmp_path, "recall", recall_result([False] * 4), seed=2)
    columns = compare.eval_summaries(compare.load_evals(tmp_path))
    assert columns["recall_accuracy@L=64"][1] == 0.0  # the latest full setting
    assert [c for c in columns if "[setting" in c] == [next(c for c in columns if c != "recall_accuracy@L=64")]
    diag = {"rows": [{"probe": "needle", "cell": "all", "n": 2, "accuracy": 1.0}], "prompt_nll": [],
            "per_example": [{"id": f"needle/{i}", "probe": "needle", "correct": True} for i in range(2)]}
    evaluate(tmp_path, "diagnostics", diag)
    evaluate(tmp_path, "diagnostics", {**diag, "rows": [{**diag["rows"][0], "accuracy": 0.0}],
                                       "per_example": [{"id": "needle/0", "probe": "needle", "correct": False}]}, limit=1)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "val_loss": 1.0}) + "\n")
    (tmp_path / "config.json").write_text(json.dumps({"model": {}, "data": {}}))
    run = sweep.load_run(tmp_path)
    assert run["accuracy"]["needle"] == 1.0 and len(run["examples"]) == 2  # not the --limit=1 check's


# ---- one run per folder ---------------------------------------------------------------------------------------

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
    from checkpoint import load_checkpoint

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
    from run_folder import claim

    claim(out, fresh=False).release()  # the kernel dropped the dead process's lock
    resumed = train_subprocess([*TINY, f"--out_dir={out}", "--max_iters=12", "--eval_interval=5",
                                "--init_from=resume"], check=False)
    assert resumed.returncode == 0, resumed.stderr


@pytest.mark.e2e
def test_a_fresh_run_never_starts_over_an_old_one_unless_asked(byte_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(byte_run, run_dir)
    (run_dir / "eval").mkdir(exist_ok=True)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    proc = train_subprocess([*TINY, f"--out_dir={run_dir}", "--max_iters=4", "--eval_interval=4"], check=False)
    assert proc.returncode == 2 and "already holds a run" in proc.stderr, proc.stderr
    assert "--init_from=resume" in proc.stderr and "--replace_run=True" in proc.stderr
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before  # nothing touched
    proc = train_subprocess([*TINY, f"--out_dir={run_dir}", "--max_iters=4", "--eval_interval=4",
                             "--replace_run=True", "--seed=7"])
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(moved) == 1 and (moved[0] / "ckpt_best.pt").read_bytes() == before["ckpt_best.pt"]
    assert (moved[0] / "eval").is_dir() and not (run_dir / "eval").exists()  # the old run moved whole
    assert max(read_metrics(run_dir)) == 4


def test_replacing_twice_in_one_second_keeps_both_old_runs_and_an_unused_folder_goes_under_its_lock(tmp_path,
                                                                                                      monkeypatch):
    import run_folder

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
    proc = train_subprocess([str(moved / "config.json"), "--init_from=resume", "--max_iters=12"])
    assert max(read_metrics(moved)) == 12 and max(read_metrics(byte_run)) == 8  # the original is untouched
    assert "resumed from " + str(moved / "ckpt_last.pt") in proc.stdout


@pytest.mark.e2e
def test_resume_tolerates_a_torn_last_log_line_and_logs_each_validation_once(byte_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(byte_run, run_dir)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "train_lo')  # a kill in the middle of a write
    proc = train_subprocess([*TINY, f"--out_dir={run_dir}", "--max_iters=12", "--eval_interval=4",
                             "--init_from=resume"])
    assert "dropped the torn last line" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    validations = [r["step"] for r in records if "val_loss" in r]
    assert validations == [0, 4, 8, 12]  # step 8 evaluated again on resume, logged once
    assert [r["step"] for r in records if "train_loss" in r] == list(range(1, 13))


@pytest.mark.e2e
def test_max_iters_zero_claims_no_checkpoint(tmp_path):
    proc = train_subprocess([*TINY, f"--out_dir={tmp_path / 'run'}", "--max_iters=0"])
    assert "no checkpoint written" in proc.stdout and "checkpoints in" not in proc.stdout
    assert not list((tmp_path / "run").glob("ckpt_*"))


# ---- faults: one line, a non-zero exit, nothing lost ------------------------------------------------------------

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
def test_a_full_disk_during_a_checkpoint_is_one_line_naming_what_is_intact(tmp_path, monkeypatch, capsys):
    import errno

    import train

    real, calls = train.save_checkpoint, []

    def save_then_fill_the_disk(obj, path):
        calls.append(path.name)
        if len(calls) > 2:  # ckpt_best.pt and ckpt_last.pt at step 4 are written, then the disk is full
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError as e:
                raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed") from e
        real(obj, path)

    monkeypatch.setattr(train, "save_checkpoint", save_then_fill_the_disk)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        train.main([*TINY, f"--out_dir={out}", "--max_iters=8", "--eval_interval=4", "--device=cpu"])
    assert exit_.value.code == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: could not write ckpt_") and "is full" in error
    assert "ckpt_best.pt (step 4)" in error and "ckpt_last.pt (step 4)" in error and "intact" in error
    assert f"python train.py {out / 'config.json'} --init_from=resume" in error
    from checkpoint import load_checkpoint

    assert load_checkpoint(out / "ckpt_last.pt")["step"] == 4  # the previous checkpoint, whole


@pytest.mark.e2e
def test_a_full_disk_outside_a_checkpoint_is_one_line_and_the_advice_works(tmp_path):
    out = tmp_path / "run"
    # in a process of its own (its run folder stays locked until it exits): the disk fills when the log first grows
    fill_the_disk_at_the_log = f"""
import builtins, errno, sys
import train

def full_for_the_log(path, mode="r", *args, **kwargs):
    if str(path).endswith("metrics.jsonl") and "a" in mode:
        raise OSError(errno.ENOSPC, "No space left on device")
    return builtins.open(path, mode, *args, **kwargs)

train.open = full_for_the_log
train.main({[*TINY, f"--out_dir={out}", "--max_iters=4", "--eval_interval=4", "--device=cpu"]!r})
"""
    proc = run(["-c", fill_the_disk_at_the_log])
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: could not write metrics.jsonl") and "is full" in error
    assert "No checkpoint of this run exists yet" in error and "--replace_run=True" in error
    # the advice works: the folder holds a partial run without a checkpoint, which a plain rerun refuses
    # without offering a resume, and --replace_run=True starts over
    proc = train_subprocess([*TINY, f"--out_dir={out}", "--max_iters=2", "--eval_interval=2"], check=False)
    assert proc.returncode == 2 and "no checkpoint to resume from" in proc.stderr, proc.stderr
    assert "--init_from=resume" not in proc.stderr and "--replace_run=True" in proc.stderr
    train_subprocess([*TINY, f"--out_dir={out}", "--max_iters=2", "--eval_interval=2", "--replace_run=True"])
    assert max(read_metrics(out)) == 2


def test_a_folder_that_cannot_take_the_old_run_aside_is_one_line(tmp_path, monkeypatch):
    import errno

    import run_folder

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


# ---- smaller ones ----------------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_a_pretrained_model_is_not_evaluated_into_a_training_runs_folder(byte_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(byte_run, run_dir)
    before = (run_dir / "config.json").read_bytes()
    proc = run(["-m", "eval"], "--hf=some/model", "--data_dir=data/embedded_byte", f"--out_dir={run_dir}", "--limit=1",
               "--progress=False")
    assert proc.returncode == 2 and "holds a training run" in proc.stderr and "--out_dir=out/hf_model" in proc.stderr
    assert (run_dir / "config.json").read_bytes() == before


@pytest.mark.e2e
def test_a_tokenizer_file_that_changed_under_its_data_is_refused(bpe, tmp_path):
    # the data was prepared with a/tokenizer.json; that path now holds another vocabulary of the same size
    shutil.copytree(bpe / "a", tmp_path / "a")
    shutil.copytree(bpe / "data_a", tmp_path / "data_a")
    meta = json.loads((tmp_path / "data_a" / "meta.json").read_text())
    meta["tokenizer"] = str(tmp_path / "a" / "tokenizer.json")
    (tmp_path / "data_a" / "meta.json").write_text(json.dumps(meta))
    shutil.copy(bpe / "b" / "tokenizer.json", tmp_path / "a" / "tokenizer.json")
    proc = train_subprocess([*TINY, f"--data_dir={tmp_path / 'data_a'}", f"--out_dir={tmp_path / 'run'}",
                             "--max_iters=1"], check=False)
    assert proc.returncode != 0 and "another vocabulary of that size" in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_pretrained_weights_refuse_data_of_another_tokenizer(tmp_path):
    folder, _ = tiny_hf.build_tiny_hf_model(tmp_path / "hf")
    proc = train_subprocess(["configs/quickstart.py", f"--init_from=hf:{folder}", "--data_dir=data/embedded_byte",
                             f"--out_dir={tmp_path / 'run'}", "--max_iters=1"], check=False)
    assert proc.returncode == 2 and "was prepared with the tokenizer 'byte'" in proc.stderr, proc.stderr
    assert f"init_from=hf:{folder}" in proc.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.e2e
def test_recurrent_mixers_inside_a_pretrained_model_are_refused_with_the_reason(tmp_path):
    folder, data_dir = tiny_hf.build_tiny_hf_model(tmp_path / "hf")
    for pattern in ("mlstm", "gated_deltanet", "linear", "swax"):
        proc = run(["-m", "eval"], f"--hf={folder}", f"--data_dir={data_dir}", f"--attn_pattern={pattern}",
                   f"--out_dir={tmp_path / pattern}", "--limit=1", "--progress=False")
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
        assert "parameters or state of its own" in proc.stderr
    proc = train_subprocess(["configs/quickstart.py", f"--init_from=hf:{folder}", f"--data_dir={data_dir}",
                             "--attn_pattern=swax", f"--out_dir={tmp_path / 'run'}", "--max_iters=1"], check=False)
    assert proc.returncode == 2 and "mlstm layers, which have no counterpart" in proc.stderr, proc.stderr
    assert "n_kv_head" not in proc.stderr


@pytest.mark.parametrize("command", [["train.py", "configs/quickstart.py", "--max_iters=1"], ["sample.py"],
                                     ["-m", "eval"]])
@pytest.mark.e2e
def test_a_device_this_machine_lacks_is_one_line(command, tmp_path):
    proc = run(command, "--device=mps", f"--out_dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and "mps" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.e2e
def test_an_unknown_tokenizer_fails_at_once_offline(tmp_path):
    import time

    started = time.time()
    proc = run(["-m", "data.prepare"], "--dataset=README.md", "--tokenizer=nobody/no-such-tokenizer",
               f"--out_dir={tmp_path / 'data'}", timeout=120)
    assert proc.returncode != 0 and "no-such-tokenizer" in proc.stderr and "Traceback" not in proc.stderr
    assert time.time() - started < 15  # not the hub client's retries (about 20 s)


def test_the_hub_probe_leaves_proxied_connections_to_the_hub_client(monkeypatch):
    import socket

    from data import tokenizer

    def refused(*args, **kwargs):
        raise OSError(111, "Connection refused")

    monkeypatch.setattr(socket, "create_connection", refused)
    for name in ("HF_HUB_OFFLINE", "HF_ENDPOINT", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY", "no_proxy",
                 "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    assert tokenizer._hub_unreachable() == "huggingface.co: Connection refused"  # no proxy: said at once
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert tokenizer._hub_unreachable() == ""  # only the proxy can say: the hub client goes through it
    monkeypatch.setenv("NO_PROXY", "huggingface.co")
    assert tokenizer._hub_unreachable() == "huggingface.co: Connection refused"


@pytest.mark.e2e
def test_prepare_says_where_a_single_documents_validation_comes_from(tmp_path):
    (tmp_path / "book.txt").write_text("Once upon a time. " * 500)
    proc = run(["-m", "data.prepare"], f"--dataset={tmp_path / 'book.txt'}", f"--out_dir={tmp_path / 'data'}")
    assert proc.returncode == 0 and "in 0 documents" not in proc.stdout and "from the end of the document" in proc.stdout


@pytest.mark.e2e
def test_a_prompt_beyond_the_training_length_is_said(byte_run):
    proc = run(["sample.py"], f"--out_dir={byte_run}", "--start=" + "a" * 40, "--max_new_tokens=4", "--num_samples=1")
    assert proc.returncode == 0 and "beyond block_size=32" in proc.stderr


@pytest.mark.e2e
def test_compare_says_repeated_seeds_and_marks_the_training_length(byte_run, tmp_path):
    from eval import compare

    runs = [tmp_path / name for name in ("a", "b")]
    for run_dir in runs:
        shutil.copytree(byte_run, run_dir)
        assert run(["-m", "eval"], f"--out_dir={run_dir}", "--ppl_lengths=16,32,64", "--limit=2",
                   "--progress=False").returncode == 0
    proc = run(["-m", "scripts.compare", *map(str, runs), "--plot", "--out", str(tmp_path / "cmp")])
    assert proc.returncode == 0, proc.stderr
    assert "2 runs, 1 seed (1337: repeated, not independent)" in proc.stdout and "2 seeds (1337, 1337)" not in proc.stdout
    records = [compare.load_local_run(r) for r in runs]
    labels, save = {}, compare._save

    def remember_lines(fig, axes, path):  # the figures are closed once saved: read their lines first
        labels[path.name] = [line.get_label() for ax in axes for line in ax.get_lines()]
        return save(fig, axes, path)

    compare._save = remember_lines
    (tmp_path / "plots").mkdir()
    compare.plot_all(records, tmp_path / "plots")
    assert "training length (32)" in labels["ppl_vs_length.png"]


@pytest.mark.e2e
def test_the_window_sweep_says_what_it_needs_instead_of_falling_back(tmp_path):
    import os

    args = ["-m", "scripts.hf_window_sweep", "--hf=some/model", "--tasks=arc_easy", f"--out={tmp_path / 'sweep'}"]
    proc = subprocess.run([sys.executable, *args, "--device=cuda"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and "CUDA is not available" in proc.stderr, proc.stderr  # not a silent CPU run
    without = ("import runpy, sys; sys.modules['lm_eval'] = None; sys.argv = " + repr(args[1:])
               + "; runpy.run_module('scripts.hf_window_sweep', run_name='__main__', alter_sys=True)")
    proc = subprocess.run([sys.executable, "-c", without], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "pip install -r requirements-eval.txt" in proc.stderr, proc.stderr
    assert not (tmp_path / "sweep").exists()


def test_two_evaluations_merge_their_cells_one_after_the_other(tmp_path):
    # the read-modify-write of eval/TASK.json is under a lock: the second merge waits for the first
    import threading

    from run_folder import held

    order = []

    def second():
        with held(tmp_path / ".lock"):
            order.append("second")

    with held(tmp_path / ".lock"):
        thread = threading.Thread(target=second)
        thread.start()
        thread.join(0.3)
        order.append("first")
    thread.join()
    assert order == ["first", "second"]
