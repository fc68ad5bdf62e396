"""Evaluation: perplexity counted exactly, candidate ranking, retrieval probes, provenance, the CLI."""

import json
import math
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from runtime.checkpoint import load_model
from config import ModelConfig
from conftest import REPO, TINY, run_in_process, take_ctrl_c, train_in_process
from data.meta import load_meta, open_tokens
from data.tokenizer import get_tokenizer
from eval import niah
from eval import ppl as ppl_task
from eval.ranking import continuation_logprobs, rank_candidates
from model import GPT


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny llama (RoPE: no length limit) trained for a few steps on the embedded corpus."""
    out = tmp_path_factory.mktemp("run")
    train_in_process(["configs/quickstart.py", f"--out_dir={out}", "--arch=llama", "--bias=False", "--n_layer=2",
                      "--n_head=2", "--n_embd=32", "--block_size=64", "--max_iters=30", "--eval_interval=30",
                      "--eval_iters=2", "--log_interval=10", "--eval_tasks=ppl,niah", "--eval_task_lengths=32,512"])
    return out


def run_eval(out, *args, check=True):
    proc = run_in_process(["-m", "eval"], f"--out_dir={out}", "--progress=False", *args)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.e2e
def test_ppl_is_exp_of_mean_nll_counted_independently(tiny_run):
    run_eval(tiny_run, "--tasks=ppl", "--ppl_lengths=16,50", "--ppl_max_tokens=3000")
    report = json.load(open(tiny_run / "eval" / "ppl.json"))
    model, cfg, _ = load_model(tiny_run, "best")
    meta = load_meta(REPO / "data" / cfg.data.dataset)
    tokens = np.asarray(open_tokens(REPO / "data" / cfg.data.dataset, "val"), dtype=np.int64)
    # independently: documents end at each end-of-text; each scored one window at a time, no batching
    docs, start = [], 0
    for end in np.flatnonzero(tokens == meta["eot_id"]):
        docs.append(tokens[start:end + 1])
        start = end + 1
    docs = docs[::-(-len(tokens) // 3000)]  # a cap below the split: every k-th document, from across it
    positions = {p["length"]: p["nll"] for p in report["results"]["positions"]}
    for row in report["results"]["rows"]:
        L, budget, nll, count = row["length"], 3000, 0.0, 0
        window_nll, position_sum, position_count = [], np.zeros(L), np.zeros(L)
        for doc in docs:
            doc = doc[:budget]
            budget -= len(doc)
            for s in range(0, len(doc) - 1, L):
                y = torch.from_numpy(doc[s + 1:s + L + 1])
                x = torch.from_numpy(doc[s:s + len(y)])
                with torch.no_grad():
                    logits, _ = model(x[None])
                token_nll = F.cross_entropy(logits[0], y, reduction="none")
                nll += token_nll.sum().item()
                count += len(y)
                window_nll.append(token_nll.mean().item())
                position_sum[:len(y)] += token_nll.numpy()
                position_count[:len(y)] += 1
            if budget <= 0:
                break
        assert row["tokens"] == count
        assert row["ppl"] == pytest.approx(math.exp(nll / count), rel=1e-5)
        assert row["nll"] == pytest.approx(nll / count, rel=1e-5)
        # each window's mean NLL (pairable per example, in window order) and the mean NLL at each position
        windows = [e for e in report["per_example"] if e["length"] == L]
        assert [e["id"] for e in windows] == [f"L{L}/{i}" for i in range(len(window_nll))]
        assert [e["nll"] for e in windows] == pytest.approx(window_nll, rel=1e-5)
        assert sum(e["tokens"] for e in windows) == count
        assert positions[L] == pytest.approx(list(position_sum / position_count), rel=1e-5)
    # beside its own numbers, the run's best validation loss from training (random windows: another sample)
    best = min(r["val_loss"] for r in map(json.loads, open(tiny_run / "metrics.jsonl")) if "val_loss" in r)
    assert all(row["run_val_loss"] == best for row in report["results"]["rows"])
    assert "run_val_loss" in (tiny_run / "eval" / "summary.md").read_text()


def test_a_token_cap_takes_documents_from_across_the_whole_split():
    eot = 0
    tokens = np.concatenate([np.r_[np.full(9, doc + 1), eot] for doc in range(100)])  # 100 documents of 10 tokens
    docs = ppl_task.documents(tokens, eot, max_tokens=250)
    assert sum(map(len, docs)) <= 250 and len(docs) == 25
    assert [int(doc[0]) for doc in docs] == list(range(1, 101, 4))  # every 4th: the split's end as its head
    assert len(ppl_task.documents(tokens, eot)) == 100


@pytest.mark.e2e
def test_every_result_carries_a_command_that_reproduces_it(tiny_run):
    run_eval(tiny_run, "--tasks=ppl,niah", "--ppl_lengths=32", "--niah_lengths=512",
             "--niah_kinds=niah_single_1,niah_multikey_2", "--niah_samples=3", "--niah_gen_tokens=8", "--niah_depths=0,1")
    first = {t: json.load(open(tiny_run / "eval" / f"{t}.json")) for t in ("ppl", "niah")}
    prov = first["niah"]["provenance"]
    assert {"command", "git_hash", "config_hash", "seed", "step"} <= set(prov)
    command = shlex.split(prov["command"])
    assert command[:3] == [command[0], "-m", "eval"]
    assert run_in_process(command[1:3], *command[3:]).returncode == 0
    for task in ("ppl", "niah"):
        again = json.load(open(tiny_run / "eval" / f"{task}.json"))
        assert again["results"] == first[task]["results"]
    assert len(first["niah"]["per_example"]) == 2 * 2 * 3
    summary = (tiny_run / "eval" / "summary.md").read_text()
    assert "## ppl" in summary and "## niah" in summary and prov["command"] in summary
    assert "| as trained | " in summary  # scored without --ppl_windows: no window is claimed for the model


@pytest.mark.e2e
def test_training_probes_are_logged(tiny_run):
    records = [json.loads(line) for line in open(tiny_run / "metrics.jsonl")]
    probes = [r for r in records if "ppl@32" in r]
    assert [r["step"] for r in probes] == [0, 30]
    assert all(r["ppl@32"] > 1 and "ppl@512" in r and 0 <= r["niah@512"] <= 1 for r in probes)


@pytest.mark.e2e
def test_limit_caps_the_work(tiny_run):
    proc = run_eval(tiny_run, "--tasks=ppl,niah", "--ppl_lengths=16", "--limit=3", "--niah_lengths=64,512",
                    "--niah_kinds=niah_single_1", "--niah_gen_tokens=8", "--niah_samples=10")
    assert "niah niah_single_1    L=64     skipped: niah length 64 leaves 56 tokens" in proc.stdout  # said, not only saved
    for task, count in (("ppl", lambda report, sid: next(r["windows"] for r in report["results"]["rows"]
                                                          if r["setting"] == sid)),
                        ("niah", lambda report, sid: len([x for x in report["per_example"] if x["setting"] == sid]))):
        report = json.load(open(tiny_run / "eval" / f"{task}.json"))
        limited = [sid for sid, setting in report["settings"].items() if setting["limit"] == 3]
        assert len(limited) == 1 and count(report, limited[0]) == 3


@pytest.mark.e2e
def test_eval_cli_errors(tiny_run, tmp_path):
    proc = run_eval(tiny_run, "--tasks=ppl,mmlu", check=False)
    assert proc.returncode == 2 and "unknown task(s) mmlu" in proc.stderr
    proc = run_eval(tmp_path, "--tasks=ppl", check=False)
    assert proc.returncode == 1 and "neither ckpt_best nor ckpt_last" in proc.stderr
    proc = run_eval(tiny_run, "--tasks=ppl", "--ckpt=middle", check=False)
    assert proc.returncode == 2 and "ckpt='middle': expected best or last" in proc.stderr
    for flag, message in (("--ppl_lengths=0", "ppl_lengths=0: every value must be >= 1"),
                          ("--niah_lengths=256,x", "niah_lengths='256,x': expected comma-separated integers")):
        proc = run_eval(tiny_run, "--tasks=ppl", flag, check=False)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_continuation_logprobs_match_a_plain_forward():
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=50)).eval()
    pairs = [([1, 2, 3], [4, 5]), ([7], [8, 9, 10, 11]), (list(range(1, 45)), [3, 4])]  # the last is cut to fit
    scores = continuation_logprobs(model, pairs, batch_size=2)
    for (context, continuation), score in zip(pairs, scores):
        seq = torch.tensor(context + continuation)[-33:]
        with torch.no_grad():
            logp = F.log_softmax(model(seq[None, :-1])[0][0], -1)
        n = len(continuation)
        expected = logp[-n:].gather(1, seq[-n:, None]).sum().item()
        assert score["logprob"] == pytest.approx(expected, abs=1e-5)
        assert score["greedy"] == bool((logp[-n:].argmax(-1) == seq[-n:]).all())


def test_candidate_ranking_finds_the_planted_answer_of_a_copy_model():
    # a model trained to copy: sequences are 8 random tokens twice; the answer is the repeat
    torch.manual_seed(0)
    vocab, half = 16, 8
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=2 * half, vocab_size=vocab))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(300):
        first = torch.randint(0, vocab, (32, half))
        seq = torch.cat([first, first], dim=1)
        _, loss = model(seq[:, :-1], seq[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    rng = np.random.default_rng(1)
    hits = 0
    for _ in range(20):
        planted = rng.integers(0, vocab, half).tolist()
        context = planted + planted[:4]
        candidates = [planted[4:]] + [rng.integers(0, vocab, 4).tolist() for _ in range(3)]
        order = rng.permutation(4)
        ranked = rank_candidates(model, context, [candidates[i] for i in order])
        hits += order[ranked["best_sum"]] == 0
    assert hits >= 18, hits


ESSAY = " ".join(f"Sentence {i} of the essay tells of rivers and hills." for i in range(400))


@pytest.mark.parametrize("kind", niah.KINDS)
def test_ruler_subtasks_are_built_as_ruler_defines_them(kind):
    tok = get_tokenizer("byte")
    essay = niah.haystack_sentences(ESSAY)
    e = niah.make_example(tok, essay, kind, 2000, None, 3, seed=7, gen_tokens=32)
    assert e == niah.make_example(tok, essay, kind, 2000, None, 3, seed=7, gen_tokens=32)  # deterministic
    assert 2000 - 32 - 200 < len(e["context"]) <= 2000 - 32  # the haystack grown to the budget
    text = tok.decode(e["context"])
    haystack, type_k, type_v, n_keys, n_values, n_asked = niah.SUBTASKS[kind]
    assert len(e["expected"]) == n_values * n_asked
    for value in e["expected"]:
        assert re.search(rf"One of the special magic {type_v} for [^ ]+ is: {value}\.", text)
    assert not any(d in text for d in e["distractors"])
    one = n_values * n_asked == 1
    assert text.startswith(f"A special magic {type_v[:-1]} is hidden" if one else f"Some special magic {type_v} are")
    assert text.endswith(f"mentioned in the provided text {'is' if one else 'are'}")
    if kind == "niah_multiquery":
        assert re.search(r"for [a-z]+-[a-z]+, [a-z]+-[a-z]+, [a-z]+-[a-z]+, and [a-z]+-[a-z]+ mentioned", text)
    if "uuids" in (type_k, type_v):
        assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", e["expected"][0])
    needles = text.count("One of the special magic")
    if haystack == "needle":
        assert needles > 10 and "\n" in text  # distractor needles, one per line, are the haystack
    else:
        assert needles == n_keys * n_values
        assert (niah.NOISE in text) == (haystack == "noise") and ("rivers and hills" in text) == (haystack == "essay")


def test_depth_places_the_asked_needle_and_string_match_gives_partial_credit():
    tok = get_tokenizer("byte")
    essay = niah.haystack_sentences(ESSAY)
    first = niah.make_example(tok, essay, "niah_single_2", 2000, 0.0, 0, seed=7, gen_tokens=32)
    last = niah.make_example(tok, essay, "niah_single_2", 2000, 1.0, 0, seed=7, gen_tokens=32)
    assert tok.decode(first["context"]).index("One of the special") < 200
    text = tok.decode(last["context"])
    assert text.index("One of the special") > 0.8 * len(text)
    assert niah.string_match_all(" 1234567, 7654321 and 42", ["1234567", "7654321", "0000000", "1111111"]) == 0.5
    assert niah.string_match_all("ABCDEF-01", ["abcdef-01"]) == 1.0  # case-insensitive, as RULER


def test_ruler_score_is_generation_and_rank_is_labelled_second():
    """An oracle that generates the expected values gets RULER's full score; its flat logits rank nothing."""
    tok = get_tokenizer("byte")
    examples = [niah.make_example(tok, niah.haystack_sentences(ESSAY), kind, 1200, None, 0, seed=1, gen_tokens=40)
                for kind in ("niah_single_1", "niah_multivalue")]
    answers = {tuple(e["context"]): tok.encode(" " + ", ".join(e["expected"][:3])) for e in examples}

    class Oracle(torch.nn.Module):
        config, wpe = None, None

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x):
            return torch.zeros(*x.shape, 257), None

        def generate(self, x, n, **kwargs):
            out = [answers[tuple(row)] + [32] * n for row in x.tolist()]
            return torch.cat([x, torch.tensor([o[:n] for o in out])], dim=1)

    records = niah.score_examples(Oracle(), tok, examples, gen_tokens=40)
    assert [r["score"] for r in records] == [1.0, 0.75]  # three of multivalue's four values: partial credit
    assert [r["correct"] for r in records] == [True, False] and not any(r["correct_rank"] for r in records)


def copy_run(run, to):
    """A copy of a trained run without its evaluations (a test that evaluates it leaves the shared run as it was)."""
    shutil.copytree(run, to, ignore=shutil.ignore_patterns("eval"))
    return to


@pytest.fixture(scope="module")
def other_data(tmp_path_factory):
    """Byte-level text of another source than the run's: a short essay, prepared as a user prepares a file."""
    folder = tmp_path_factory.mktemp("other")
    text = folder / "essay.txt"
    text.write_text("\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog, {i} times." * 3
                                for i in range(60)))
    proc = run_in_process(["-m", "data.prepare"], f"--dataset={text}", f"--out_dir={folder / 'essay'}",
                          "--val_fraction=0.2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder / "essay"


@pytest.mark.e2e
def test_evaluations_on_other_data_are_labelled_and_never_the_runs_own(tiny_run, other_data, tmp_path):
    """Perplexity on other data than the run's own validation split never sits in the plain column, in the
    summary, in the plots or in a paired test: it is named by its data, however recently it was computed."""
    from eval.compare import CompareError
    from eval.paired import paired
    from eval.plots import ppl_series
    from eval.records import load_local_run
    from eval.summaries import eval_summaries

    run = copy_run(tiny_run, tmp_path / "run")
    run_eval(run, "--tasks=ppl", "--ppl_lengths=32")
    proc = run_eval(run, "--tasks=ppl", "--ppl_lengths=32", f"--data_dir={other_data}")  # the most recent
    assert "is not this run's own validation split" in proc.stderr
    assert not (run / "eval" / ".lock").exists()  # the merge's lock is gone once the write is done
    report = json.load(open(run / "eval" / "ppl.json"))
    by_data = {s["data"]["name"]: (sid, s["data"]["own"]) for sid, s in report["settings"].items()}
    assert by_data["embedded_byte"][1] and not by_data["essay"][1]
    ppl = {name: next(r["ppl"] for r in report["results"]["rows"] if r["setting"] == sid)
           for name, (sid, _) in by_data.items()}
    assert ppl["essay"] != ppl["embedded_byte"]
    # the run's own validation loss stands beside its own split's cells only
    carries = {name: "run_val_loss" in next(r for r in report["results"]["rows"] if r["setting"] == sid)
               for name, (sid, _) in by_data.items()}
    assert carries == {"embedded_byte": True, "essay": False}
    columns = {k: v for k, (_, v) in eval_summaries(load_local_run(run)["evals"]).items()}
    assert columns == {"ppl@L=32": ppl["embedded_byte"], "ppl@L=32 (data essay)": ppl["essay"]}
    rows, label = ppl_series(load_local_run(run)["evals"]["ppl"])
    assert [r["ppl"] for r in rows] == [ppl["embedded_byte"]] and "data" not in label
    assert "data=essay" in (run / "eval" / "summary.md").read_text()
    # a run evaluated on the other data only: its plots say so, and it never pairs with the run's own windows
    other = copy_run(tiny_run, tmp_path / "other_only")
    run_eval(other, "--tasks=ppl", "--ppl_lengths=32", f"--data_dir={other_data}")
    assert ppl_series(load_local_run(other)["evals"]["ppl"])[1]["data"] == " (data essay)"
    own = copy_run(tiny_run, tmp_path / "own_only")
    run_eval(own, "--tasks=ppl", "--ppl_lengths=32")
    with pytest.raises(CompareError, match="on different text"):
        paired(load_local_run(own), load_local_run(other), "ppl", key="nll")


@pytest.mark.e2e
def test_every_perplexity_cell_says_how_much_text_it_scored(tiny_run, tmp_path):
    """Tokens, windows and the standard error of each cell, printed and saved; a cell of fewer than MIN_WINDOWS
    windows is a warning on screen, a flag in the results and a mark in compare's table."""
    from eval.records import load_local_run
    from eval.tables import build_tables, render

    run = copy_run(tiny_run, tmp_path / "run")
    proc = run_eval(run, "--tasks=ppl", "--ppl_lengths=64", "--ppl_max_tokens=700")
    report = json.load(open(run / "eval" / "ppl.json"))
    (row,) = report["results"]["rows"]
    windows = [e for e in report["per_example"] if e["length"] == 64]
    assert row["windows"] == len(windows) < ppl_task.MIN_WINDOWS and row["few_windows"]
    assert row["tokens"] == sum(e["tokens"] for e in windows) and row["val_tokens"] > 700
    # the standard error with windows as the units, computed here from the saved windows
    n = np.array([e["tokens"] for e in windows], dtype=float)
    s = np.array([e["nll"] for e in windows]) * n
    k, mean = len(n), s.sum() / n.sum()
    assert row["nll_stderr"] == pytest.approx(math.sqrt(k / (k - 1) * ((s - mean * n) ** 2).sum()) / n.sum())
    assert f"{row['tokens']:,} tokens in {row['windows']} windows" in proc.stdout and "±" in proc.stdout
    assert f"scores 700 of the {row['val_tokens']:,} validation tokens (--ppl_max_tokens): documents from across the " \
        "whole split" in proc.stdout
    assert f"only {row['windows']} windows" in proc.stderr and "warning" in proc.stderr
    text = render(build_tables([load_local_run(run)]))
    assert f"{row['ppl']:.3f} †" in text and f"ppl@L=64: {row['windows']} windows" in text
    # enough windows: no flag
    run_eval(run, "--tasks=ppl", "--ppl_lengths=16", "--ppl_max_tokens=3000")
    report = json.load(open(run / "eval" / "ppl.json"))
    assert not next(r for r in report["results"]["rows"] if r["length"] == 16)["few_windows"]


@pytest.mark.e2e
def test_sample_refuses_a_generation_that_cannot_fit_before_allocating_it(tiny_run):
    """A llama-arch run's caches for a billion new tokens: refused up front, with the limit and the fix."""
    proc = run_in_process(["sample.py"], f"--out_dir={tiny_run}", "--max_new_tokens=1000000000")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    fit = int(re.search(r"at most about ([\d,]+) new tokens fit", proc.stderr)[1].replace(",", ""))
    assert 0 < fit < 1_000_000_000 and "lower --max_new_tokens" in proc.stderr


@pytest.mark.e2e
def test_a_learned_position_run_says_how_to_get_one_that_extrapolates(byte_run):
    """The quick start's learned positions end at its block_size: a longer length is skipped with the option that
    trains a model that can be scored there, and the README says so where it shows evaluation."""
    proc = run_eval(byte_run, "--tasks=ppl", "--ppl_lengths=16,64", "--limit=2")
    skipped = [line for line in proc.stdout.splitlines() if "L=64" in line]
    assert skipped and "skipped" in skipped[0] and "--pos_embedding=rope" in skipped[0], proc.stdout
    readme = (REPO / "README.md").read_text()
    evaluation = readme[readme.index("python -m eval --out_dir=out/quickstart"):]
    assert "--pos_embedding=rope" in evaluation[:1200] and "--ppl_lengths=256,512,1024" in evaluation[:1200]


@pytest.mark.e2e
def test_a_ctrl_c_during_an_evaluation_ends_in_one_line_saying_what_was_written(tiny_run, tmp_path):
    out = copy_run(tiny_run, tmp_path / "run")
    with open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "eval", f"--out_dir={out}", "--progress=False",
                                 "--tasks=ppl,niah", "--ppl_lengths=32", "--niah_lengths=512", "--niah_samples=100000"],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr, text=True,
                                preexec_fn=take_ctrl_c)
    try:
        while not (out / "eval" / "ppl.json").exists():  # ppl written; niah has long to go
            assert proc.poll() is None, (tmp_path / "stderr").read_text()
            time.sleep(0.05)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    said = (tmp_path / "stderr").read_text()
    assert proc.returncode == 130 and "Traceback" not in said, said[-3000:]
    assert said.strip().splitlines()[-1].startswith("interrupted during task niah: ppl.json written, niah not")
    assert (out / "eval" / "summary.md").exists() and not (out / "eval" / "niah.json").exists()


@pytest.mark.e2e
def test_an_sa_evaluation_says_its_results_are_drawn_and_sa_mode_deterministic_fixes_them(tmp_path):
    out = tmp_path / "sa"
    train_in_process([*TINY, f"--out_dir={out}", "--attn_pattern=sa_swa,full", "--swa_window=16", "--max_iters=4",
                      "--eval_interval=4"])
    args = ["--tasks=ppl", "--ppl_lengths=32", "--ppl_max_tokens=2000"]
    drawn = [run_eval(out, *args, f"--seed={seed}") for seed in (1, 2)]
    assert all("note: the results are drawn per forward" in p.stderr for p in drawn)
    nll = lambda: json.load(open(out / "eval" / "ppl.json"))["results"]["rows"][-1]["nll"]  # noqa: E731
    fixed = []
    for seed in (1, 2):
        proc = run_eval(out, *args, f"--seed={seed}", "--sa_mode=deterministic")
        assert "drawn per forward" not in proc.stderr
        fixed.append(nll())
    assert fixed[0] == fixed[1]
    bad = run_eval(out, "--sa_mode=sometimes", check=False)
    assert bad.returncode == 2 and "sa_mode='sometimes'" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
