"""Evaluation results keep what they were measured under: every setting of the run and of the evaluation, each
checkpoint's results apart, per-example results merged, limited ones marked; compare pairs runs under a setting both
were evaluated under and says what it cannot compare; prompts and sweeps say what does not fit."""

import json
import shutil

import pytest

from conftest import run_in_process as run


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

    from common.outputs import write_json
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
    from eval.paired import paired
    from eval.records import load_evals

    # A evaluated with seed 1 then 2, B with seed 2 then 1: each file's newest setting differs, the pair must not
    a, b = tmp_path / "a", tmp_path / "b"
    evaluate(a, "recall", recall_result([True] * 8), seed=1)
    evaluate(a, "recall", recall_result([True] * 4 + [False] * 4), seed=2)
    evaluate(b, "recall", recall_result([False] * 8), seed=2)
    evaluate(b, "recall", recall_result([True] * 8), seed=1)
    records = [{"name": d.name, "source": str(d), "evals": load_evals(d)} for d in (a, b)]
    out = paired(*records, "recall")
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
    from eval import bridge_tables
    from eval.records import load_evals
    from eval.summaries import eval_summaries

    evaluate(tmp_path, "recall", recall_result([True] * 4), seed=1)
    evaluate(tmp_path, "recall", recall_result([False] * 4), seed=2)
    columns = eval_summaries(load_evals(tmp_path))
    assert columns["recall_accuracy@L=64"][1] == 0.0  # the latest full setting
    assert [c for c in columns if "[setting" in c] == [next(c for c in columns if c != "recall_accuracy@L=64")]
    diag = {"rows": [{"probe": "needle", "cell": "all", "n": 2, "accuracy": 1.0}], "prompt_nll": [],
            "per_example": [{"id": f"needle/{i}", "probe": "needle", "correct": True} for i in range(2)]}
    evaluate(tmp_path, "diagnostics", diag)
    evaluate(tmp_path, "diagnostics", {**diag, "rows": [{**diag["rows"][0], "accuracy": 0.0}],
                                       "per_example": [{"id": "needle/0", "probe": "needle", "correct": False}]}, limit=1)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "val_loss": 1.0}) + "\n")
    (tmp_path / "config.json").write_text(json.dumps({"model": {}, "data": {}}))
    run = bridge_tables.load_run(tmp_path)
    assert run["accuracy"]["needle"] == 1.0 and len(run["examples"]) == 2  # not the --limit=1 check's


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
def test_a_prompt_beyond_the_training_length_is_said(byte_run):
    proc = run(["sample.py"], f"--out_dir={byte_run}", "--start=" + "a" * 40, "--max_new_tokens=4", "--num_samples=1")
    assert proc.returncode == 0 and "beyond block_size=32" in proc.stderr


@pytest.mark.e2e
def test_compare_says_repeated_seeds_and_marks_the_training_length(byte_run, tmp_path, monkeypatch):
    from eval import plots
    from eval.records import load_local_run

    runs = [tmp_path / name for name in ("a", "b")]
    for run_dir in runs:
        shutil.copytree(byte_run, run_dir)
        assert run(["-m", "eval"], f"--out_dir={run_dir}", "--ppl_lengths=16,32,64", "--limit=2",
                   "--progress=False").returncode == 0
    proc = run(["-m", "scripts.compare", *map(str, runs), "--plot", "--out", str(tmp_path / "cmp")])
    assert proc.returncode == 0, proc.stderr
    assert "2 runs, 1 seed (1337: repeated, not independent)" in proc.stdout and "2 seeds (1337, 1337)" not in proc.stdout
    records = [load_local_run(r) for r in runs]
    labels, save = {}, plots._save

    def remember_lines(fig, axes, path):  # the figures are closed once saved: read their lines first
        labels[path.name] = [line.get_label() for ax in axes for line in ax.get_lines()]
        return save(fig, axes, path)

    monkeypatch.setattr(plots, "_save", remember_lines)
    (tmp_path / "plots").mkdir()
    plots.plot_all(records, tmp_path / "plots")
    assert "training length (32)" in labels["ppl_vs_length.png"]


@pytest.mark.e2e
def test_the_window_sweep_says_what_it_needs_instead_of_falling_back(tmp_path, monkeypatch):
    import sys

    import torch

    args = ["-m", "scripts.sa.hf_window_sweep", "--hf=some/model", "--tasks=arc_easy", f"--out={tmp_path / 'sweep'}"]
    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)  # no GPU, even on a GPU machine
        proc = run(args, "--device=cuda")
    assert proc.returncode == 2 and "CUDA is not available" in proc.stderr, proc.stderr  # not a silent CPU run
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # not installed: its import fails
    proc = run(args)
    assert proc.returncode == 2 and "pip install -r requirements-eval.txt" in proc.stderr, proc.stderr
    assert not (tmp_path / "sweep").exists()


def test_two_evaluations_merge_their_cells_one_after_the_other(tmp_path):
    # the read-modify-write of eval/TASK.json is under a lock: the second merge waits for the first
    import threading

    from common.run_folder import held

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
