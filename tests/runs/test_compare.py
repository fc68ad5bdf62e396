"""Run comparison: eval/stats.py and scripts/compare.py (tables, seed groups, plots, paired tests, wandb)."""

import dataclasses
import json
import math
import random
import sys
import types
from pathlib import Path

import pytest

from config import Config
from conftest import load_script, run_in_process
from eval.paired import paired, render_paired
from eval.plots import plot_all, seed_group_records
from eval.records import load_local_run, wandb_record
from eval.stats import mcnemar_exact, mean_std, paired_bootstrap_ci, paired_comparison
from eval.summaries import eval_summaries
from eval.tables import build_tables, render

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# ---- fake runs --------------------------------------------------------------------------------------------

VAL = {"full_s1": [5.0, 2.0, 1.5], "full_s2": [5.0, 1.6, 1.7], "swa_s1": [5.0, 2.2, 1.8]}  # best: 1.5, 1.6, 1.8
FINAL_TRAIN = {"full_s1": 1.40, "full_s2": 1.45, "swa_s1": 1.75}
NIAH_ACC = {"full_s1": 0.75, "full_s2": 0.5, "swa_s1": 0.25}
N_EXAMPLES = 12


def model_overrides(name):
    return {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 64, "vocab_size": 320, "swa_window": 16,
            "attn_pattern": "swa" if name.startswith("swa") else "full"}


def per_example(name):
    """full_s1 gets examples 0-5 right (and 6-11 wrong); swa_s1 gets 0-11 right: a_only=0, b_only=6."""
    right = {"full_s1": range(6), "full_s2": range(4), "swa_s1": range(12)}[name]
    return [{"id": f"single/L=64/d=0.0/i={i}", "kind": "single", "length": 64, "correct": i in right}
            for i in range(N_EXAMPLES)]


def make_run(root: Path, name: str, seed: int) -> Path:
    """A run folder as train.py leaves one; full_s1's config.json as runs were saved before they kept only their
    own mixers' settings (every variant's, here swa_window=16 though its layers have no window)."""
    run = root / name
    (run / "eval").mkdir(parents=True)
    config = Config()
    for key, value in model_overrides(name).items():
        setattr(config.model, key, value)
    for key, value in {"seed": seed, "out_dir": str(run), "batch_size": 4, "gradient_accumulation_steps": 2,
                       "max_iters": 100, "wandb_run_name": name}.items():
        setattr(config.train, key, value)
    cfg = dataclasses.asdict(config) if name == "full_s1" else config.to_dict()
    meta = {"tokenizer": "byte", "vocab_size": 257, "train_tokens": 10000, "created": f"2026-01-0{seed}"}
    info = {"command": f"python train.py --seed={seed}", "git_hash": f"abc{seed}", "world_size": 1,
            "torch": "2.13.0", "started": f"2026-01-0{seed}T00:00:00"}
    (run / "config.json").write_text(json.dumps({**cfg, "run": info, "data_meta": meta}, indent=2))
    lines = []
    for step, val in zip((0, 50, 100), VAL[name]):
        lines.append({"step": step, "val_loss": val, "best_val_loss": min(VAL[name][:(step // 50) + 1])})
        if step:
            for s in range(step - 40, step + 1, 10):
                loss = FINAL_TRAIN[name] if s == 100 else 3.0 - s / 100
                lines.append({"step": s, "train_loss": loss, "lr": 1e-3, "tokens_per_s": 1000.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    ppl_rows = [{"length": n, "window": w, "ppl": 3.0 + 0.1 * seed + (0.3 if w else 0) + n / 512,
                 "nll": 1.0, "tokens": 1000} for n in (64, 128, 256) for w in (None, 32)]
    niah_rows = [{"kind": kind, "length": n, "depth": d, "n": 4,
                  "acc_generate": 0.0, "acc_rank": NIAH_ACC[name] * (1 if kind == "single" else 0.5)}
                 for kind in ("single", "multikey") for n in (64, 128) for d in (0.0, 0.5, 1.0)]
    provenance = {"command": "python -m eval", "git_hash": "abc", "config_hash": "x", "seed": 1337,
                  "ckpt": str(run / "ckpt_best.pt"), "step": 100}
    (run / "eval" / "ppl.json").write_text(json.dumps(
        {"task": "ppl", "results": {"rows": ppl_rows}, "provenance": provenance}))
    (run / "eval" / "niah.json").write_text(json.dumps(
        {"task": "niah", "results": {"rows": niah_rows}, "per_example": per_example(name), "provenance": provenance}))
    return run


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "out"
    return [make_run(root, "full_s1", 1), make_run(root, "full_s2", 2), make_run(root, "swa_s1", 1)]


def run_cli(*args):
    """python -m scripts.compare ARGS, run in this process: the command line's parsing, output and exit status are
    what is checked, not a fresh interpreter."""
    return run_in_process(["-m", "scripts.compare"], *map(str, args))


def table_rows(text, section="## Runs"):
    """{first cell: {header: cell}} of the markdown table under a section heading."""
    lines = text.split(section, 1)[1].splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("|")):]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells))
    return header, rows


# ---- stats ------------------------------------------------------------------------------------------------

def test_mcnemar_exact_known_values():
    # a_only=0, b_only=6: p = 2 * 0.5**6
    r = mcnemar_exact([True] * 3 + [False] * 6 + [False], [True] * 3 + [True] * 6 + [False])
    assert (r["both_correct"], r["a_only"], r["b_only"], r["neither"]) == (3, 0, 6, 1)
    assert r["p_value"] == pytest.approx(0.03125, abs=1e-15)
    # a_only=1, b_only=8: p = 2 * (C(9,0) + C(9,1)) / 2^9, computed independently
    a = [True] + [False] * 8 + [True] * 5
    b = [False] + [True] * 8 + [True] * 5
    r = mcnemar_exact(a, b)
    assert (r["a_only"], r["b_only"], r["both_correct"], r["neither"]) == (1, 8, 5, 0)
    assert r["p_value"] == pytest.approx(2 * (math.comb(9, 0) + math.comb(9, 1)) / 2**9, abs=1e-15)
    assert mcnemar_exact(b, a)["p_value"] == r["p_value"]  # symmetric
    assert mcnemar_exact([True, False], [True, False])["p_value"] == 1.0  # no discordant pairs
    assert mcnemar_exact([True] * 5 + [False] * 5, [False] * 5 + [True] * 5)["p_value"] == 1.0  # capped at 1
    with pytest.raises(ValueError):
        mcnemar_exact([True], [True, False])


def test_paired_bootstrap_ci_covers_truth_and_is_deterministic():
    rng = random.Random(0)
    a = [1.0] * 90 + [0.0] * 10
    b = [1.0] * 50 + [0.0] * 50
    rng.shuffle(b)
    true_diff = sum(a) / 100 - sum(b) / 100  # 0.4
    r = paired_bootstrap_ci(a, b, n_boot=2000, seed=3)
    assert r["diff"] == pytest.approx(true_diff)
    assert r["ci_low"] < true_diff < r["ci_high"]
    assert r["ci_low"] > 0.2 and r["ci_high"] < 0.6  # a clear difference: the interval excludes 0
    assert paired_bootstrap_ci(a, b, n_boot=2000, seed=3) == r
    assert paired_bootstrap_ci(a, b, n_boot=2000, seed=4) != r
    booleans = paired_bootstrap_ci([x > 0 for x in a], [x > 0 for x in b], n_boot=2000, seed=3)
    assert (booleans["ci_low"], booleans["ci_high"]) == (r["ci_low"], r["ci_high"])
    # a constant difference has a zero-width interval
    const = paired_bootstrap_ci([2.0, 3.0, 4.0], [1.0, 2.0, 3.0], n_boot=100)
    assert const["ci_low"] == pytest.approx(1.0) and const["ci_high"] == pytest.approx(1.0)


def test_mean_std():
    assert mean_std([1, 2, 3, 4]) == pytest.approx((2.5, math.sqrt(5 / 3)))
    assert mean_std([5.0]) == (5.0, 0.0)


def test_paired_comparison_counts_and_id_join():
    a = [{"id": f"x{i}", "correct": i < 6} for i in range(10)]             # right on 0-5
    b = [{"id": f"x{i}", "correct": 3 <= i < 10} for i in reversed(range(10))]  # right on 3-9, other order
    r = paired_comparison(a, b)
    assert r["n"] == 10
    assert (r["acc_a"], r["acc_b"]) == (0.6, 0.7)
    assert (r["a_only"], r["b_only"], r["both_correct"], r["neither"]) == (3, 4, 3, 0)
    assert r["mcnemar"]["p_value"] == pytest.approx(1.0)
    assert r["bootstrap"]["diff"] == pytest.approx(-0.1)
    with pytest.raises(ValueError, match=r"1 of A's 10 ids are missing from B.*1 of B's 10 ids"):
        paired_comparison(a, b[:-1] + [{"id": "other", "correct": True}])
    with pytest.raises(ValueError, match="twice"):
        paired_comparison(a, b + [b[0]])


def test_paired_comparison_of_losses_uses_the_sign_test():
    # per-window losses: A lower on 7 windows, B lower on 2, one tie; the sign test is McNemar on who is lower
    a = [{"id": f"w{i}", "nll": 1.0 + (0.1 if i in (7, 8) else -0.2 if i < 7 else 0.0)} for i in range(10)]
    b = [{"id": f"w{i}", "nll": 1.0} for i in range(10)]
    r = paired_comparison(a, b, key="nll")
    assert r["binary"] is False
    assert (r["a_only"], r["b_only"]) == (7, 2)
    assert r["mcnemar"]["p_value"] == pytest.approx(2 * sum(math.comb(9, i) for i in range(3)) / 2**9, abs=1e-15)
    assert r["acc_a"] == pytest.approx(1.0 + (2 * 0.1 - 7 * 0.2) / 10)
    assert r["bootstrap"]["diff"] == pytest.approx((2 * 0.1 - 7 * 0.2) / 10)
    assert paired_comparison([{"id": 0, "correct": True}], [{"id": 0, "correct": False}])["binary"] is True


# ---- the command line -------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_table_groups_and_plots(runs, tmp_path):
    out = tmp_path / "cmp"
    proc = run_cli(*runs, "--plot", "--out", out)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    header, rows = table_rows(text)
    # the config diff: seed and attn_pattern differ, and swa's window tells it from full (whose layers have none);
    # nothing else (out_dir, run info, data.created are ignored)
    assert header[:4] == ["run", "attn_pattern", "swa_window", "seed"]
    for unchanged in ("n_layer", "learning_rate", "out_dir", "wandb_run_name", "command", "git_hash",
                      "data.created", "block_size"):
        assert unchanged not in header
    assert rows["swa_s1"]["attn_pattern"] == "swa" and rows["full_s2"]["seed"] == "2"
    assert rows["swa_s1"]["swa_window"] == "16" and rows["full_s1"]["swa_window"] == "-"
    # best val loss is the minimum (full_s2's is at step 50, not the last evaluation), final train loss the last
    assert [rows[n]["best val loss"] for n in ("full_s1", "full_s2", "swa_s1")] == ["1.5000", "1.6000", "1.8000"]
    assert rows["full_s2"]["final train loss"] == "1.4500"
    assert rows["full_s1"]["tokens"] == f"{100 * 4 * 2 * 64:,}"  # last train step x batch x accumulation x block
    # parameters: the model built from the config
    import torch

    from model import GPT
    cfg = Config()
    for key, value in model_overrides("full").items():
        setattr(cfg.model, key, value)
    with torch.device("meta"):
        n_params = GPT(cfg.model).num_params()
    assert rows["full_s1"]["params"] == f"{n_params / 1e6:.2f}M" != ""
    # eval summaries: ppl per (length, window); niah rank accuracy per length, averaged over depth and kind
    assert rows["full_s1"]["ppl@L=64"] == f"{3.1 + 64 / 512:.3f}"
    assert rows["full_s1"]["ppl@L=256,w=32"] == f"{3.1 + 0.3 + 256 / 512:.3f}"
    assert rows["full_s1"]["niah_rank@L=128"] == f"{(0.75 + 0.375) / 2:.3f}"
    assert not any(c.startswith("niah_rank@L=128,") or "depth" in c for c in header)
    # seed groups: the two full runs, mean +- sample std
    gheader, groups = table_rows(text, "## Seed groups")
    full = groups["full"]
    assert full["seeds"].startswith("2 seeds")
    mean, std = mean_std([1.5, 1.6])
    assert full["best val loss"] == f"{mean:.4f} ± {std:.4f}" == "1.5500 ± 0.0707"
    assert groups["swa"]["seeds"].startswith("1 seed")
    assert groups["swa"]["best val loss"] == "1.8000"
    # files
    assert (out / "compare.md").read_text() == text
    for name in ("loss_curves.png", "ppl_vs_length.png", "retrieval_vs_distance.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE, name
        assert len(data) > 5000, f"{name} is only {len(data)} bytes"


@pytest.mark.e2e
def test_not_a_run_folder(runs, tmp_path):
    (runs[0] / "metrics.jsonl").unlink()
    proc = run_cli(runs[0], runs[1])  # e.g. out/*/ matching a folder that is not a run: skipped, said so
    assert proc.returncode == 0 and "skipped" in proc.stderr and str(runs[0]) in proc.stderr
    assert "metrics.jsonl" in proc.stderr and runs[1].name in proc.stdout and f"| {runs[0].name} " not in proc.stdout
    proc = run_cli(runs[0])
    assert proc.returncode == 2 and "metrics.jsonl" in proc.stderr and "config.json" not in proc.stderr
    proc = run_cli(tmp_path / "nowhere")
    assert proc.returncode == 2 and "nowhere" in proc.stderr


@pytest.mark.e2e
def test_paired_cli(runs, tmp_path):
    out = tmp_path / "paired"
    proc = run_cli("--paired", runs[0], runs[2], "--task", "niah", "--out", out)
    assert proc.returncode == 0, proc.stderr
    header, rows = table_rows(proc.stdout, "## Paired comparison")
    row = rows["full_s1"]
    assert (row["B"], row["n"], row["acc A"], row["acc B"], row["A only"], row["B only"]) == \
        ("swa_s1", "12", "0.500", "1.000", "0", "6")
    assert row["McNemar p"] == "0.0312"
    saved = json.loads((out / "paired_niah_full_s1_vs_swa_s1.json").read_text())
    assert saved["all"]["mcnemar"]["p_value"] == 0.03125
    assert (saved["all"]["a_only"], saved["all"]["b_only"]) == (0, 6)
    assert saved["all"]["bootstrap"]["diff"] == pytest.approx(-0.5)
    assert saved["a"]["provenance"]["step"] == 100
    # mismatched ids: a clear error, exit 2
    data = json.loads((runs[2] / "eval" / "niah.json").read_text())
    data["per_example"][0]["id"] = "renamed"
    (runs[2] / "eval" / "niah.json").write_text(json.dumps(data))
    proc = run_cli("--paired", runs[0], runs[2], "--task", "niah", "--out", out)
    assert proc.returncode == 2 and "ids do not match" in proc.stderr
    proc = run_cli("--paired", runs[0], runs[2], "--task", "lambada", "--out", out)
    assert proc.returncode == 2 and "eval/lambada.json" in proc.stderr


class FakeRun:
    def __init__(self, name, seed, attn, val, train):
        cfg = Config().to_dict()
        cfg["model"].update({**model_overrides(attn), "attn_pattern": attn})
        cfg["train"].update({"seed": seed, "batch_size": 2, "gradient_accumulation_steps": 3, "max_iters": 30})
        cfg["data"] = {"dataset": "embedded_byte", "data_dir": ""}
        self.name, self.id, self.path = name, name + "id", ["ent", "proj", name + "id"]
        self.config = {**cfg, "run": {"git_hash": name}, "n_params": 123456}
        self.summary = {"train_loss": train[-1], "best_val_loss": min(val), "val_loss": val[-1], "_step": 30,
                        "_runtime": 5.0, "lr": 1e-4, "ppl@1024": 2.5}
        self.curves = {"train_loss": [{"_step": 10 * (i + 1), "train_loss": v} for i, v in enumerate(train)],
                       "val_loss": [{"_step": 15 * i, "val_loss": v} for i, v in enumerate(val)]}
        self.history_calls = []

    def history(self, samples=500, keys=None, x_axis="_step", pandas=True, stream="default"):
        self.history_calls.append(keys)
        assert len(keys) == 1
        return list(self.curves.get(keys[0], []))  # wandb: no rows for a key the run never logged


def test_wandb_path_with_fake_api(monkeypatch, capsys, tmp_path):
    fake_runs = [FakeRun("w_full_1", 1, "full", [4.0, 2.5, 2.0], [3.0, 2.2, 2.1]),
                 FakeRun("w_full_2", 2, "full", [4.0, 2.4, 2.2], [3.0, 2.3, 2.0]),
                 FakeRun("w_swa", 1, "swa", [4.0, 3.0, 2.6], [3.0, 2.8, 2.7]),
                 FakeRun("other", 3, "swa", [1.0], [1.0])]
    paths = []

    class FakeApi:
        def runs(self, path, filters=None, **kwargs):
            paths.append(path)
            return iter(fake_runs)

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(Api=FakeApi))
    compare = load_script("compare")
    rc = compare.main(["--wandb", "ent/proj", "--runs", "w_full_1,w_full_2,w_swa", "--out", str(tmp_path / "w"),
                       "--plot"])
    assert rc == 0 and paths == ["ent/proj"]
    text = capsys.readouterr().out
    header, rows = table_rows(text)
    assert set(rows) == {"w_full_1", "w_full_2", "w_swa"}  # --runs filters by name
    assert header[:3] == ["run", "attn_pattern", "swa_window"] and "seed" in header and "git_hash" not in header
    assert rows["w_full_1"]["best val loss"] == "2.0000" and rows["w_full_2"]["best val loss"] == "2.2000"
    assert rows["w_full_2"]["final train loss"] == "2.0000"
    assert rows["w_swa"]["tokens"] == f"{30 * 2 * 3 * 64:,}"
    assert rows["w_swa"]["params"] == "0.12M"  # run.config's n_params
    assert rows["w_swa"]["ppl@1024"] == "2.500"  # a summary metric becomes a column
    assert "lr" not in header and "_runtime" not in header
    assert ["train_loss"] in fake_runs[0].history_calls and ["val_loss"] in fake_runs[0].history_calls
    _, groups = table_rows(text, "## Seed groups")
    assert groups["full"]["seeds"].startswith("2 seeds")
    assert groups["full"]["best val loss"] == "2.1000 ± 0.1414"
    assert (tmp_path / "w" / "loss_curves.png").read_bytes()[:8] == PNG_SIGNATURE
    # the record is the same shape as a local run's: the table code takes plain dicts
    record = wandb_record(fake_runs[2])
    assert record["train"] == [(10, 3.0), (20, 2.8), (30, 2.7)] and record["best_val_loss"] == 2.6
    with pytest.raises(compare.CompareError, match="no wandb runs"):
        compare.main(["--wandb", "ent/proj", "--runs", "missing"])


def test_eval_summaries_are_per_length_and_generic():
    evals = {
        "niah": {"rows": [{"kind": "single", "length": 64, "depth": 0.0, "n": 4, "acc_generate": 0.0, "acc_rank": 1.0},
                          {"kind": "multikey", "length": 64, "depth": 0.5, "n": 12, "acc_generate": 0.0,
                           "acc_rank": 0.5},
                          {"kind": "single", "length": 64, "depth": 1.0, "n": 0, "acc_generate": 0.0,
                           "acc_rank": 0.0}]},  # an empty cell carries no weight
        "ppl": {"rows": [{"length": 512, "window": None, "ppl": None, "nll": None, "tokens": 0, "note": "too long"},
                         {"length": 128, "window": None, "ppl": 2.5, "nll": 0.9, "tokens": 100}]},
        "probes": {"rows": [{"kind": "copy", "length": 128, "acc": 0.5, "n": 10},
                            {"kind": "copy", "length": 128, "acc": 1.0, "n": 30},
                            {"kind": "copy", "length": 256, "acc": 0.25, "n": 10},
                            {"name": "overall", "score": 0.3}]},
    }
    values = {k: v for k, (_, v) in eval_summaries(evals).items()}
    assert values == {"niah_rank@L=64": pytest.approx((4 * 1.0 + 12 * 0.5) / 16), "ppl@L=128": 2.5,
                      "probes_acc@L=128": pytest.approx(0.875), "probes_acc@L=256": 0.25, "probes_score": 0.3}


def test_what_a_new_user_should_not_be_misled_by(runs, tmp_path, capsys):
    """An unfinished run is marked; a step-0 loss is never "best"; the trained window's perplexity is the plain
    column; a setting is shown only for the runs whose mixers read it; the validation plot starts after step 0
    with the unigram baseline; no plot is written without data."""
    full, _, swa = runs
    config = json.loads((swa / "config.json").read_text())
    config["model"].update({"swat_split": "8:4"})  # a swat setting: neither run's mixers read it
    config["data_meta"]["unigram_entropy"] = 3.2
    (swa / "config.json").write_text(json.dumps(config))
    (full / "metrics.jsonl").write_text(json.dumps({"step": 0, "val_loss": 5.0}) + "\n" +
                                        json.dumps({"step": 10, "train_loss": 4.0}) + "\n")
    ppl = json.loads((swa / "eval" / "ppl.json").read_text())
    ppl["results"]["trained_window"] = 32
    (swa / "eval" / "ppl.json").write_text(json.dumps(ppl))
    full_record, swa_record = load_local_run(full), load_local_run(swa)
    assert full_record["best_val_loss"] is None and "stopped at step 10 of 100" in full_record["incomplete"]
    assert swa_record["incomplete"] == ""
    tables = build_tables([full_record, swa_record])
    # swat_split: no run reads it; swa_window: only swa's layers read it, which tells it from full
    assert "swat_split" not in tables["diff_keys"] and "swa_window" in tables["diff_keys"]
    assert "swa_window" not in tables["rows"][0]["flat"] and tables["rows"][1]["flat"]["swa_window"] == 16
    assert "ppl@L=64" in tables["rows"][1]["cells"] and "ppl@L=64,w=32" not in tables["rows"][1]["cells"]
    text = render(tables)
    assert "full_s1 (incomplete: stopped at step 10 of 100)" in text
    written = plot_all([swa_record], tmp_path)
    assert tmp_path / "loss_curves.png" in written
    empty = {**swa_record, "train": [], "val": [(0, 5.0)], "evals": {}}
    assert plot_all([empty], tmp_path / "none") == [] and not (tmp_path / "none" / "loss_curves.png").exists()
    assert "no training or validation losses to plot" in capsys.readouterr().err


@pytest.mark.e2e
def test_position_gain_over_a_reference_by_offset_from_block_boundaries(runs, tmp_path):
    """NLL by window position (the ppl eval's profiles): swa_s1 is 0.5 nats better than the full group just
    after each block boundary (offsets [0, 8) of 16) and equal elsewhere; the first block is left out."""
    length, block = 64, 16

    def profile(name, seed):
        base = 2.0 + 0.2 * (seed - 1)  # full_s1 2.0, full_s2 2.2: the reference group's mean is 2.1
        if name.startswith("swa"):
            return [2.1 - (0.5 if t >= block and t % block < 8 else 0.0) for t in range(length)]
        return [base] * length

    for run, seed in zip(runs, (1, 2, 1)):
        config = json.loads((run / "config.json").read_text())
        config["model"]["block_len"] = block
        (run / "config.json").write_text(json.dumps(config))
        data = json.loads((run / "eval" / "ppl.json").read_text())
        data["results"]["positions"] = [{"length": length, "window": None, "nll": profile(run.name, seed)},
                                        {"length": 128, "window": None, "nll": [9.0] * 128}]
        (run / "eval" / "ppl.json").write_text(json.dumps(data))
    out = tmp_path / "cmp"
    proc = run_cli(*runs, "--plot", "--out", out, "--position_gain", "full_s1", "--position_bin", "8")
    assert proc.returncode == 0, proc.stderr
    header, rows = table_rows(proc.stdout, "## NLL by window position")
    assert header == ["model", "all after the first block", "offset [0, 8)", "offset [8, 16)"]
    assert list(rows) == ["swa"]  # named by its runs without the seed; the reference group is not a row
    assert rows["swa"]["offset [0, 8)"] == "+0.5000 ± 0.0000"
    assert rows["swa"]["offset [8, 16)"] == "+0.0000 ± 0.0000"
    assert rows["swa"]["all after the first block"] == "+0.2500 ± 0.0000"
    assert "over full" in proc.stdout and "L=64" in proc.stdout
    data = (out / "position_gain.png").read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 5000
    # a run evaluated without the profile at that length: one line naming the eval command, exit 2
    proc = run_cli(*runs, "--position_gain", "full_s1", "--position_length", "256")
    assert proc.returncode == 2 and "--ppl_lengths=256" in proc.stderr
    proc = run_cli(*runs, "--position_gain", "nobody")
    assert proc.returncode == 2 and "no such run" in proc.stderr


@pytest.mark.e2e
def test_paired_cli_on_per_window_losses(runs, tmp_path):
    # the ppl eval's per-window losses: full_s1 lower on windows 0-7, swa_s1 lower on 8-9
    for run, offset in ((runs[0], 0.0), (runs[2], 0.1)):
        data = json.loads((run / "eval" / "ppl.json").read_text())
        data["per_example"] = [{"id": f"L64/{i}", "cell": "L64", "length": 64, "tokens": 64,
                                "nll": 1.0 + (offset if i < 8 else -offset)} for i in range(10)]
        (run / "eval" / "ppl.json").write_text(json.dumps(data))
    proc = run_cli("--paired", runs[0], runs[2], "--task", "ppl", "--key", "nll", "--by", "cell", "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "exact sign test" in proc.stdout
    header, rows = table_rows(proc.stdout, "## Paired comparison")
    assert header[5:10] == ["mean A", "mean B", "A lower", "B lower", "sign test p"]
    row = rows["full_s1"]
    assert (row["mean A"], row["mean B"], row["A lower"], row["B lower"]) == ("1.0000", "1.0600", "8", "2")
    assert row["sign test p"] == f"{2 * sum(math.comb(10, i) for i in range(3)) / 2**10:.3g}"
    assert row["A - B [95% CI]"].startswith("-0.0600 [")


def test_plots_draw_a_seed_group_as_its_mean_over_seeds(runs, tmp_path):
    records = [load_local_run(r) for r in runs]
    tables = build_tables(records)
    plotted = {r["name"]: r for r in seed_group_records(records, tables)}
    assert set(plotted) == {"full (2 seeds)", "swa_s1"}  # a group of several seeds is one series
    group = plotted["full (2 seeds)"]
    assert group["val"] == [(0, 5.0), (50, pytest.approx(1.8)), (100, pytest.approx(1.6))]  # VAL's means
    assert group["val_std"][1] == pytest.approx(mean_std([2.0, 1.6])[1])
    at_64 = next(r for r in group["evals"]["ppl"]["rows"] if r["length"] == 64 and r["window"] is None)
    assert at_64["ppl"] == pytest.approx(3.15 + 64 / 512) and at_64["ppl_std"] == pytest.approx(mean_std([3.1, 3.2])[1])
    assert plotted["swa_s1"] is records[2]
    written = plot_all(list(plotted.values()), tmp_path)
    assert {p.name for p in written} == {"loss_curves.png", "ppl_vs_length.png", "retrieval_vs_distance.png"}


def test_ppl_plot_keeps_every_marker_visible_at_one_length(runs, tmp_path, monkeypatch):
    """Windows evaluated at one length are drawn at that length (never moved along the axis), as nested hollow
    markers of decreasing size so none hides another, and the trained window is the model as trained: one
    series, labelled as both."""
    swa = runs[2]
    rows = [{"length": 256, "window": w, "ppl": p, "nll": 1.0, "tokens": 1000, "windows": 40}
            for w, p in ((None, 3.0), (8, 3.4), (16, 3.0), (32, 3.1))]
    (swa / "eval" / "ppl.json").write_text(json.dumps(
        {"task": "ppl", "results": {"rows": rows, "trained_window": 16}, "provenance": {"step": 100}}))
    drawn = {}

    def keep(fig, axes, path):
        drawn[path.name] = [(line.get_label(), list(line.get_xdata()), line.get_markersize(), line.get_fillstyle())
                            for line in axes[0].get_lines() if not line.get_label().startswith("training length")]
        return path

    monkeypatch.setattr("eval.plots._save", keep)
    plot_all([load_local_run(swa)], tmp_path)
    series = drawn["ppl_vs_length.png"]
    assert [s[0] for s in series] == ["swa_s1 (as trained, window 16)", "swa_s1 (window 8)", "swa_s1 (window 32)"]
    assert [s[1] for s in series] == [[256]] * 3  # each at its own length
    sizes = [s[2] for s in series]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 3 and {s[3] for s in series} == {"none"}


def test_the_table_shows_what_ran_its_speed_and_its_wall_time(tmp_path):
    """Settings given as auto show what they became (config.json's resolved), and the training speed and wall time
    come from metrics.jsonl: the median tokens/s and MFU of the logged steps after each invocation's first, and
    the last elapsed_s."""
    runs = [make_run(tmp_path, "full_s1", 1), make_run(tmp_path, "swa_s1", 1)]
    for run, positions, kernel, speeds in ((runs[0], "learned", "sdpa", [50.0, 900.0, 1000.0, 1100.0]),
                                           (runs[1], "rope", "chunked", [60.0, 1900.0, 2000.0, 2100.0])):
        cfg = json.loads((run / "config.json").read_text())
        assert cfg["model"]["pos_embedding"] == "auto"
        cfg["resolved"] = {"pos_embedding": positions, "attn_backend": kernel, "device": "cpu"}
        (run / "config.json").write_text(json.dumps(cfg))
        lines = [{"step": 10 * (i + 1), "train_loss": 2.0, "tokens_per_s": v, "mfu": v / 1e4, "elapsed_s": 30.0 * i}
                 for i, v in enumerate(speeds)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    tables = build_tables([load_local_run(r) for r in runs])
    assert "pos_embedding" in tables["diff_keys"] and "attn_backend" in tables["diff_keys"]
    rows = {row["run"]: row for row in tables["rows"]}
    assert rows["full_s1"]["flat"]["pos_embedding"] == "learned" and rows["swa_s1"]["flat"]["pos_embedding"] == "rope"
    assert rows["full_s1"]["cells"]["tokens/s"] == 1000.0 and rows["swa_s1"]["cells"]["tokens/s"] == 2000.0
    assert rows["full_s1"]["cells"]["MFU"] == pytest.approx(0.1) and rows["full_s1"]["cells"]["wall time"] == 90.0
    text = render(tables)
    assert "learned" in text and "rope" in text and "tokens/s" in text and "1,000" in text and "1.5 min" in text
    assert "auto" not in text.split("## Runs")[1].splitlines()[2]  # the header's first row: no "auto" value


def test_params_of_a_model_this_version_cannot_build_are_a_warning_and_any_other_failure_raises(tmp_path, monkeypatch,
                                                                                                 capsys):
    """A run saved by another version (here a mixer since removed) has no params cell, and says why on stderr;
    a failure that is no config problem (a bug in building the model) is not hidden behind an empty cell."""
    from eval import tables as tables_module

    monkeypatch.setattr(tables_module, "_PARAMS_CACHE", {})
    run = make_run(tmp_path, "full_s1", 1)
    cfg = json.loads((run / "config.json").read_text())
    cfg["model"]["attn_pattern"] = "retired_mixer"
    (run / "config.json").write_text(json.dumps(cfg))
    (row,) = build_tables([load_local_run(run)])["rows"]
    assert row["cells"]["params"] is None
    err = capsys.readouterr().err
    assert "warning: cannot build the model of attn_pattern='retired_mixer'" in err and "unknown mixer" in err

    def broken(config):
        raise RuntimeError("a bug in GPT")

    monkeypatch.setattr(tables_module, "GPT", broken)
    with pytest.raises(RuntimeError, match="a bug in GPT"):
        build_tables([load_local_run(make_run(tmp_path, "swa_s1", 1))])


def test_pooled_perplexity_cells_are_no_test_and_tiny_p_values_are_bounds(tmp_path):
    """ppl scores the same text at every length: its windows pooled over lengths are not independent, so the
    pooled row is labelled as no test and each length is a test of its own; a p-value under 1e-16 is a bound."""
    from eval.stats import format_p

    runs = [make_run(tmp_path, "full_s1", 1), make_run(tmp_path, "swa_s1", 1)]
    for run, shift in zip(runs, (0.0, 0.05)):
        data = json.loads((run / "eval" / "ppl.json").read_text())
        data["per_example"] = [{"id": f"L{n}/{i}", "cell": f"L{n}", "length": n, "nll": 1.0 + shift + 0.001 * (i % 7)}
                               for n in (128, 256) for i in range(64)]
        (run / "eval" / "ppl.json").write_text(json.dumps(data))
    records = [load_local_run(r) for r in runs]
    result = paired(records[0], records[1], "ppl", key="nll", n_boot=200)
    assert result["by"] == "cell" and set(result["groups"]) == {"L128", "L256"}
    assert "not independent" in result["all"]["not_a_test"] and result["all"]["n"] == 128
    text = render_paired(result)
    all_row = next(line for line in text.splitlines() if "| all " in line)
    assert "not a test" in all_row and "e-" not in all_row.split("|")[-3]
    assert format_p(0.0) == "< 1e-16" and format_p(3e-20) == "< 1e-16" and format_p(0.0123) == "0.0123"
    assert "< 1e-16" in text  # 64 windows all lower in a cell: the exact sign test's 2^-63, below 1e-16
