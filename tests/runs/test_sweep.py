import shutil
import subprocess

import pytest

from conftest import REPO, run_in_process


@pytest.mark.e2e
def test_sweep_trains_compares_and_resumes(tmp_path, python_children_in_process):
    configs = []
    for pattern in ("full", "swa"):
        path = tmp_path / f"tiny_{pattern}.py"
        window = "swa_window = 8\n" if pattern == "swa" else ""  # a setting only the pattern that reads it may have
        path.write_text(f'include("configs/quickstart.py")\nn_layer = 2\nn_head = 2\nn_embd = 32\nblock_size = 32\n'
                        f'batch_size = 4\nmax_iters = 4\neval_interval = 4\neval_iters = 2\nlog_interval = 2\n'
                        f'attn_pattern = "{pattern}"\n{window}')
        configs.append(str(path))
    out = tmp_path / "sweep"
    # the sweep in this process, and the training runs, evaluations and comparison it starts too (conftest's
    # python_children_in_process): its resume logic is what is checked here, not its processes
    args = [*configs, f"--out={out}", "--eval=--tasks=ppl --ppl_lengths=16"]
    first = run_in_process(["-m", "scripts.sweep"], *args)
    assert first.returncode == 0, first.stderr[-2000:]
    results = (out / "results.md").read_text()
    assert "python -m scripts.sweep" in results and "tiny_full" in results and "tiny_swa" in results
    assert "ppl@L=16" in results and (out / "loss_curves.png").exists()
    (out / "tiny_swa" / "eval" / "summary.md").unlink()  # as if interrupted between training and evaluation
    again = run_in_process(["-m", "scripts.sweep"], *args)
    assert again.returncode == 0 and again.stdout.count("already finished, kept") == 2
    assert (out / "tiny_swa" / "eval" / "summary.md").exists()  # evaluated on the rerun, not retrained

    # tiny_full as if killed before its first checkpoint (its config and log written, nothing to resume), and
    # tiny_swa's log with a last line torn by a kill: the rerun starts tiny_full again, its partial folder moved
    # aside, and keeps tiny_swa
    for checkpoint in (out / "tiny_full").glob("ckpt_*.pt"):
        checkpoint.unlink()
    shutil.rmtree(out / "tiny_full" / "eval")
    with open(out / "tiny_swa" / "metrics.jsonl", "a") as log:
        log.write('{"step": 5, "train_lo')
    third = run_in_process(["-m", "scripts.sweep"], *args)
    assert third.returncode == 0, third.stdout[-2000:] + third.stderr[-2000:]
    assert "tiny_swa: already finished, kept" in third.stdout and "--replace_run=True" in third.stdout
    assert (out / "tiny_full" / "ckpt_last.pt").exists() and (out / "tiny_full" / "eval" / "summary.md").exists()
    assert [p.name.split(".replaced-")[0] for p in out.glob("*.replaced-*")] == ["tiny_full"]


@pytest.mark.e2e  # it runs git
def test_the_documented_results_name_commits_that_exist():
    """docs/results.md: a section re-run after the kernels changed names the commit its numbers come from (the
    embedded-corpus MSWA table, which a user re-ran and found moved), and every commit it names is one of this
    repository's."""
    import re

    text = (REPO / "docs" / "results.md").read_text()
    mswa = text[text.index("### MSWA: multi-scale window attention (paper 002, Tables 2 and 6), CPU scale"):]
    mswa = mswa[:mswa.index("\n### ", 10)]
    assert re.search(r"Re-run at commit [0-9a-f]{7}", mswa) and "0.3371" in mswa
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True,
                             text=True).stdout.strip() == "true"
    if shallow:  # a clone without the history cannot look the commits up
        return
    for commit in set(re.findall(r"\bat commit ([0-9a-f]{7,40})\b|\bat ([0-9a-f]{7,40})\b", text)):
        name = next(c for c in commit if c)
        found = subprocess.run(["git", "cat-file", "-e", f"{name}^{{commit}}"], cwd=REPO, capture_output=True)
        assert found.returncode == 0, f"docs/results.md names commit {name}, which this repository lacks"
