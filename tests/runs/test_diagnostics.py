"""Paper 004's diagnostics: probe geometry and determinism, balanced four-candidate scoring, the evaluation task
end to end with paired comparison of two checkpoints, and the Table 3 / 4 / 9 writer."""

import json
import math

import numpy as np
import pytest
import torch

from conftest import REPO, run_in_process, train_in_process
from data.meta import open_tokens
from data.prepare import prepare_generated_if_missing
from data.tokenizer import ByteTokenizer
from eval.diagnostics import FORMATS, PROBES, Builder, Geometry, haystack, make_examples, score
from eval.bridge_tables import tables

GEOMETRY = Geometry(length=512, block=64, half=32)


@pytest.fixture(scope="module")
def builder(builders):
    return builders["notes"]


@pytest.fixture(scope="module")
def builders():
    data_dir = str(REPO / "data" / "embedded_byte")
    prepare_generated_if_missing(data_dir)
    text = np.asarray([t for t in open_tokens(data_dir, "val")[:100_000] if t != 256], dtype=np.int64)
    return {f: Builder(ByteTokenizer(), haystack(f, ByteTokenizer(), text)) for f in FORMATS}


@pytest.mark.parametrize("fact_format,probe", [(f, p) for f in FORMATS for p in FORMATS[f]])
def test_probes_are_deterministic_and_place_the_answer_where_they_say(builders, fact_format, probe):
    builder = builders[fact_format]
    examples = make_examples(builder, GEOMETRY, probe, 8, seed=0, distances=[48, 96, 300], fact_format=fact_format)
    assert examples == make_examples(builder, GEOMETRY, probe, 8, 0, [48, 96, 300], fact_format)
    assert examples != make_examples(builder, GEOMETRY, probe, 8, 1, [48, 96, 300], fact_format)
    tok = builder.tok
    for e in examples:
        assert len(e["context"]) == e["readout"] + 1 <= GEOMETRY.length
        answer = e["candidates"][e["answer"]]
        start = e["readout"] - e["distance"]
        assert e["context"][start:start + len(answer)] == answer  # the true answer sits d positions back
        assert len({tuple(c) for c in e["candidates"]}) == 4
        if probe in ("bridge_window", "semantic_boundary"):  # answer in [p - h, p), readout in [p, p + h)
            p = (e["readout"] // 64) * 64
            assert p - 32 <= start < p and e["readout"] % 64 < 32 and p >= 64
        if probe == "needle":
            # the requested distance, or the shortest the fact's texts allow (about 50 bytes here)
            assert e["readout"] == GEOMETRY.length - 1
            assert e["distance"] == e["d"] if e["d"] > 60 else e["d"] <= e["distance"] <= 60
        if fact_format == "recall":  # "#k=V|" in counting digits, asked as "?k>" with value letters as candidates
            text = tok.decode(e["context"])
            key = text[-2]
            assert text.endswith(f"?{key}>") and f"#{key}={tok.decode(answer)}|" in text
            assert set(text) - set("0123456789") == set(f"#{key}={tok.decode(answer)}|?>")
            assert all(len(c) == 1 and tok.decode(c).isupper() for c in e["candidates"])
        if probe == "boundary_tail":
            assert start % 64 >= 48 and e["readout"] % 64 >= 32 and e["readout"] // 64 == start // 64 + 1
        if probe == "semantic_distractor":  # the other candidates are stated too
            text = tok.decode(e["context"])
            assert all(tok.decode(c).strip() in text for c in e["candidates"])
    positions = [e["answer"] for e in examples]
    assert len(examples) >= 8
    assert sorted(set(positions)) == [0, 1, 2, 3] and len(set(positions.count(k) for k in range(4))) == 1


class Uniform(torch.nn.Module):
    """A model that predicts every token with the same probability: every candidate ties."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config, self.wpe = None, None

    def forward(self, idx):
        return torch.zeros(*idx.shape, 300) + self.weight, None


def test_recall_format_has_no_semantic_probes(builders):
    with pytest.raises(ValueError, match="no recall form"):
        make_examples(builders["recall"], GEOMETRY, "semantic_exact", 4, 0, [48], "recall")


def test_scoring_ranks_by_nll_over_balanced_candidates(builder):
    examples = make_examples(builder, GEOMETRY, "needle", 8, seed=0, distances=[64])
    records = score(Uniform(), examples, batch_size=4)
    # ties go to the first candidate, which is the answer in exactly a quarter of the balanced examples
    assert sum(r["correct"] for r in records) / len(records) == 0.25
    assert all("context" not in r and r["probe"] == "needle" for r in records)


def train(out, pattern, data="bridges_cpu"):
    """The paper's CPU config for PATTERN (its own file: a bridge setting on the command line of a pattern that
    reads none is refused), made tiny."""
    return train_in_process([f"configs/bridges/{data}_{pattern}.py", f"--out_dir={out}", "--n_layer=2", "--n_embd=32",
                             "--max_iters=2", "--eval_interval=2", "--eval_iters=1", "--batch_size=2"], check=False)


@pytest.mark.e2e
def test_one_command_runs_every_diagnostic_and_one_compares_two_checkpoints(tmp_path):
    runs = {}
    for pattern in ("block", "pbb"):
        runs[pattern] = tmp_path / pattern
        assert train(runs[pattern], pattern).returncode == 0
        proc = run_in_process(["-m", "eval"], f"--out_dir={runs[pattern]}", "--tasks=diagnostics", "--diag_samples=2",
                              "--diag_distances=48,200", "--progress=False")
        assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((runs["pbb"] / "eval" / "diagnostics.json").read_text())
    assert {row["probe"] for row in report["results"]["rows"]} == set(PROBES)
    assert len(report["results"]["prompt_nll"]) == 512 // 16
    assert report["results"]["prompt_nll_boundary"]  # Fig. 5b: the boundary-focused prompts
    offsets = [row["cell"] for row in report["results"]["rows"] if row["probe"] == "boundary_sweep" and row["cell"] != "all"]
    assert offsets == [f"offset={o}" for o in range(-32, 32)]  # token resolution around the boundary (h = 32)
    assert "| diagnostics" not in (runs["pbb"] / "eval" / "summary.md").read_text()  # the markdown table
    assert "| probe | cell | n | accuracy |" in (runs["pbb"] / "eval" / "summary.md").read_text()
    proc = run_in_process(["-m", "scripts.compare"], "--paired", str(runs["pbb"]), str(runs["block"]), "--task",
                          "diagnostics", "--by", "probe", "--out", str(tmp_path / "cmp"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "probe=bridge_window" in proc.stdout and "McNemar" in proc.stdout


@pytest.mark.e2e
def test_a_run_trained_on_recall_is_asked_in_the_recall_format(tmp_path):
    assert train(tmp_path, "pbb", "bridges_cpu_recall").returncode == 0
    evaluate = lambda *extra: run_in_process(["-m", "eval"], f"--out_dir={tmp_path}",  # noqa: E731
                                             "--tasks=diagnostics", "--diag_samples=2", "--progress=False", *extra)
    proc = evaluate()
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "eval" / "diagnostics.json").read_text())["results"]
    assert report["format"] == "recall" and {r["probe"] for r in report["rows"]} == set(FORMATS["recall"])
    refused = evaluate("--diag_probes=semantic_exact")
    assert refused.returncode != 0 and "not available in the recall format" in refused.stderr


def fake_run(accuracy: dict, examples: list, ppl: float):
    return {"ppl": ppl, "accuracy": accuracy, "examples": examples, "prompt_nll": [],
            "model": {"block_size": 512, "block_len": 64, "bridge_width": 64, "bridge_extension": 32},
            "geometry": {"length": 512, "block": 64, "half": 32}}


def test_tables_follow_equations_42_43_and_pair_identical_prompts():
    ids = [f"bridge_window/window=0/{i}" for i in range(100)]
    correct = {"block": 40, "swa": 100, "pbb": 85}  # first k of the 100 prompts right
    runs = {f: {1337: fake_run({"bridge_window": k / 100}, [{"id": i, "probe": "bridge_window", "correct": n < k}
                                                           for n, i in enumerate(ids)], ppl=31.0 - k / 100)}
            for f, k in correct.items()}
    text, data = tables(runs)
    # Eq. 42: 0.85 - 0.40; Eq. 43: 0.45 / (1.00 - 0.40); 7 boundaries x 32 write-back positions
    assert "| pbb | 0.850 | +0.450 | 75.0% | +0.201 (224 of 512) |" in text
    row = next(p for p in data["paired"] if (p["a"], p["b"]) == ("pbb", "block"))
    assert (row["n"], row["a_only"], row["b_only"]) == (100, 45, 0)
    assert math.isclose(row["bootstrap"]["diff"], 0.45)
    assert "| swa | **30.00** | **1.000** |" in text and "| block | 30.60 |" in text  # bold: best local
    assert "| Architecture | Best PPL | Bridge-window |" in text  # only the probes the runs were asked


def test_sample_sizes_default_to_the_papers(builder):
    # 004 Table 9: 400 bridge-window and 1,600 needle prompts per seed, spread evenly over the cells
    assert len(make_examples(builder, GEOMETRY, "bridge_window", 0, seed=0, distances=[48])) == 400
    needle = make_examples(builder, GEOMETRY, "needle", 0, seed=0, distances=[48, 96, 300])
    assert len(needle) == 1600 and {sum(e["d"] == d for e in needle) for d in (48, 96, 300)} == {533, 534}


def test_per_seed_tables_and_figures_2_to_5(tmp_path):
    from eval.bridge_tables import figures

    def run(family, seed, skill):
        examples = [{"id": f"needle/d={d}/{i}", "probe": "needle", "d": d, "correct": (i + d) % 10 < skill}
                    for d in (64, 128, 256) for i in range(10)]
        examples += [{"id": f"boundary_sweep/offset={o}/{i}", "probe": "boundary_sweep", "offset": o,
                      "correct": o >= 0 or i < skill} for o in range(-4, 4) for i in range(4)]
        nll = [{"bin_start": 1 + 16 * k, "nll": 3.0 - skill / 10 * (k % 4 == 0)} for k in range(32)]
        accuracy = {"needle": sum(e["correct"] for e in examples if e["probe"] == "needle") / 30}
        return {**fake_run(accuracy, examples, ppl=30.0 - skill), "prompt_nll": nll, "prompt_nll_boundary": nll}

    runs = {f: {seed: run(f, seed, skill + (seed == 1337)) for seed in (1337, 2025)}
            for f, skill in (("block", 2), ("pbb", 6), ("swa", 8))}
    text, _ = tables(runs)
    assert "## Table 6: per-seed perplexity and standard needle retrieval" in text
    assert "| pbb | 1337 | 23.00 |" in text and "| pbb | 2025 | 24.00 |" in text
    names = sorted(p.name for p in figures(runs, tmp_path))
    assert names == ["fig2_needle_by_distance.png", "fig4_boundary_offset.png", "fig5_prompt_nll.png"]
    assert all((tmp_path / n).read_bytes()[:4] == b"\x89PNG" for n in names)


def test_facts_corpus_asks_every_fact_back_after_stating_it():
    import re

    from data.facts import document, documents

    assert list(documents(5)) == list(documents(5)) and document(0, 3) != document(1, 3)
    asked = 0
    for index in range(100):
        lines = document(0, index).split("\n")
        for i, line in enumerate(lines):
            code = re.fullmatch(r"What is the code of the (\w+ \w+)\? It is (\d+)\.", line)
            where = re.fullmatch(r"Where does (\w+) keep the (\w+)\? In the (\w+ \w+)\.", line)
            if code:
                assert f"The code of the {code[1]} is {code[2]}." in lines[:i]
            if where:
                assert f"{where[1]} keeps the {where[2]} in the {where[3]}." in lines[:i]
            asked += bool(code or where)
    assert asked > 200


def test_the_probes_geometry_is_the_runs_own_and_a_run_without_blocks_is_asked_for_it():
    from config import ConfigError, ModelConfig
    from eval.__main__ import EvalRunConfig, diagnostics_geometry

    def geometry(pattern, **given):
        model = ModelConfig(attn_pattern=pattern, block_size=512, block_len=64, bridge_width=48, bridge_extension=16)
        g = diagnostics_geometry(EvalRunConfig(**given), model)
        return g.length, g.block, g.half

    assert geometry("pbb") == (512, 64, 24)  # h = w / 2
    assert geometry("se_bridge") == (512, 64, 16)  # h = e
    assert geometry("block") == (512, 64, 32)  # h = b / 2: the paper's w = b
    assert geometry("full", diag_block=128, diag_half=40, diag_length=256) == (256, 128, 40)
    with pytest.raises(ConfigError, match="read no block_len.*--diag_block=B"):
        geometry("swa")
