"""scripts/gpu_bench.py on the CPU (--device=cpu: the script's code at small sizes; its numbers are a GPU's only on
one): every case in a process of its own, timed only once all are warm, in the tables the GPU run prints."""

import json

import pytest
import torch

from conftest import run_in_process


@pytest.mark.e2e
def test_the_benchmark_times_each_case_after_all_are_warm_and_prints_its_tables(tmp_path):
    out = tmp_path / "bench"
    # the benchmark's driver in this process: each case still runs in a process of its own
    proc = run_in_process(["-m", "scripts.gpu_bench"], "--device=cpu", "--parts=kernels,nanogpt",
                          "--kernel_variants=full,swa,block,swa@32x16x4x2", "--lengths=96,160", "--batch=1",
                          "--heads=2", "--head_dim=16", "--window=32", "--repeats=1", "--jobs=2", f"--out={out}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = (out / "report.md").read_text()
    assert "a check of the script, not a measurement" in report  # never passed off as a GPU's numbers
    assert "time per allowed edge / swa" in report and "swa@32x16x4x2" in report
    assert "nanogpt: left out (give --nanogpt=PATH" in report  # no nanoGPT file: said, not silently dropped
    results = json.loads((out / "gpu_bench.json").read_text())
    rows = {(r["variant"], r["n"]) for r in results["kernels"]}
    assert rows == {(v, n) for v in ("full", "swa", "block", "swa@32x16x4x2") for n in (96, 160)}
    assert results["errors"] == {}
    for case in ("kernels_swa", "kernels_block"):  # each waited for every case before timing
        log = (out / "logs" / f"{case}.log").read_text()
        assert log.index("ready; waiting for every case") < log.index("timing")
        assert "warm at n=96" in log and "warm at n=160" in log


@pytest.mark.e2e
def test_the_benchmark_writes_only_into_a_folder_of_its_own(tmp_path):
    """It empties its logs and results inside --out before each run: a folder holding anything else is refused
    before anything runs, and left as it was."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "mine.log").write_text("a user's log")
    proc = run_in_process(["-m", "scripts.gpu_bench"], "--device=cpu", f"--out={tmp_path}")
    assert proc.returncode == 2 and "did not write" in proc.stderr, proc.stderr
    assert [p.name for p in tmp_path.rglob("*")] == ["logs", "mine.log"]


@pytest.mark.e2e
def test_training_cases_run_in_rounds_and_the_profiled_ones_say_where_their_step_goes(tmp_path):
    """--jobs=1: each case a round of its own (a round's cases alone hold the GPU's memory); --train_profile: the
    kernels that took a step's time, in the report."""
    out = tmp_path / "bench"
    # a small model (VARIANT:KEY=VALUE settings): the config's own width and vocabulary take 15 s a step in bf16 on
    # the CPU, and the script, not the model, is what is checked
    small = ":n_embd=64:n_head=2:vocab_size=256"
    full, swa = f"full{small}", f"swa{small}"
    proc = run_in_process(["-m", "scripts.gpu_bench"], "--device=cpu", "--parts=train",
                          f"--train_variants={full},{swa}", f"--train_profile={swa}", "--train_layers=1",
                          "--train_len=64", "--train_window=16", "--train_steps=1", "--train_compile=False", "--jobs=1",
                          f"--out={out}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = (out / "report.md").read_text()
    assert f"Where {swa}'s training step spends its time" in report and f"Where {full}'s" not in report
    assert "| host ms | GPU busy ms |" in report and "eager bf16" in report  # said as run: not compiled
    results = json.loads((out / "gpu_bench.json").read_text())
    profiled = {r["variant"]: r["profile"] for r in results["train"]}
    assert profiled[full] == [] and profiled[swa] and all(p["ms_per_step"] >= 0 for p in profiled[swa])
    # the host's time to enqueue a step (here all of it) in every row; the GPU's busy time only from a GPU's profile
    assert all(0 < r["host_ms"] <= r["step_ms"] for r in results["train"])
    assert [r["gpu_busy_ms"] for r in results["train"]] == [None, None]
    # one round after the other: the second started once the first was timed
    assert proc.stdout.index(f"round 1/2: train:{full}") < proc.stdout.index(f"round 2/2: train:{swa}")


def test_training_cases_take_settings_and_compare_with_full_attention_under_the_same_ones():
    """VARIANT:KEY=VALUE trains one case with train.py's settings (the defaults time full and swa with CUDA graphs
    too), and its "vs full" is against full attention with the same settings."""
    from scripts.gpubench.options import GRAPH_CASES, default_variants
    from scripts.gpubench.report import train_table

    assert set(GRAPH_CASES) <= set(default_variants()[1]) and "full:cuda_graphs=True" in GRAPH_CASES
    row = lambda name, tokens_per_s: {"variant": name, "step_ms": 1.0, "tokens_per_s": tokens_per_s,  # noqa: E731
                                      "mfu": 0.1, "max_memory_gib": 1.0}
    table = train_table([row("full", 100.0), row("swa", 120.0), row("full:cuda_graphs=True", 200.0),
                         row("swa:cuda_graphs=True", 300.0)])[0]
    assert "| swa | 1.0 | - | - | 120 | 1.20x |" in table
    assert "| swa:cuda_graphs=True | 1.0 | - | - | 300 | 1.50x |" in table


def test_a_training_case_with_cuda_graphs_but_no_compilation_is_refused():
    from config import ConfigError
    from scripts.gpubench.cases import train_case
    from scripts.gpubench.options import BenchConfig

    with pytest.raises(ConfigError, match="add --train_compile=True"):
        train_case("swa:cuda_graphs=True", BenchConfig(device="cpu", train_compile=False), None)


def test_each_round_leaves_the_report_so_far_and_no_round_waits_past_the_timeout(tmp_path, monkeypatch):
    """A run stopped from outside (a lent machine's time running out) keeps what its finished rounds measured:
    after_round is called after every round but the last, with the results so far."""
    from scripts.gpubench import rounds
    from scripts.gpubench.options import BenchConfig

    monkeypatch.setattr(rounds, "run_round", lambda b, argv, out, batch, started: {key: [{"case": key}]
                                                                                  for key in batch})
    (tmp_path / "ready").mkdir()
    calls = []
    results = rounds.run_jobs(BenchConfig(parts="kernels", kernel_variants="full,swa,block", jobs=2), [], tmp_path,
                              after_round=lambda so_far, done, total: calls.append((sorted(so_far), done, total)))
    assert calls == [([("kernels", "full"), ("kernels", "swa")], 1, 2)]
    assert set(results) == {("kernels", "full"), ("kernels", "swa"), ("kernels", "block")}


def test_rounds_hold_what_the_gpus_memory_allows():
    """A round's cases fit the GPU's memory as well as --jobs: on an 80 GiB H100 twelve training cases at 8K warmed
    up at once and five ran out of memory; kernels cases still go twelve to a round, and the CPU has no limit."""
    from scripts.gpubench.options import BenchConfig
    from scripts.gpubench.rounds import plan_rounds

    b = BenchConfig(jobs=12)
    train = [("train", f"v{i}") for i in range(12)]
    kernels = [("kernels", f"k{i}") for i in range(12)]
    rounds = plan_rounds(kernels + train + [("nanogpt", "gpt2_124m")], b, 79.2)
    assert [len(r) for r in rounds] == [12, 6, 6, 1]
    assert [case for r in rounds for case in r] == kernels + train + [("nanogpt", "gpt2_124m")]  # order kept
    assert [len(r) for r in plan_rounds(train, b, 139.8)] == [11, 1]  # an H200
    assert [len(r) for r in plan_rounds(train, BenchConfig(jobs=12, train_len=32768), 79.2)] == [1] * 12
    assert [len(r) for r in plan_rounds(train, b, 0.0)] == [12]


@pytest.mark.e2e
def test_a_round_begun_near_the_timeout_stops_its_late_cases_by_the_timeout(tmp_path):
    """--ready_by counts from a round's start, but no round waits past --timeout: the cases not warm by then are
    stopped and reported, the rounds not begun are reported, and the report is written."""
    out = tmp_path / "bench"
    proc = run_in_process(["-m", "scripts.gpu_bench"], "--device=cpu", "--parts=kernels",
                          "--kernel_variants=full,swa", "--lengths=96", "--jobs=1", "--timeout=1",
                          "--ready_by=600", f"--out={out}")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = json.loads((out / "gpu_bench.json").read_text())["errors"]
    assert "or by --timeout=1 s: stopped" in errors["kernels:full"]
    assert errors["kernels:swa"] == "not started before --timeout=1 s"
    assert "not started before --timeout=1 s" in (out / "report.md").read_text()


def test_a_training_case_that_fla_would_refuse_on_hopper_is_refused_before_it_compiles(monkeypatch):
    """fla refuses its gated backward on Hopper under Triton 3.4.0-3.7.0 (fla #640), but only after its kernels
    compile (a minute of a round's warm-up on an H100): the case says so at once, and only for a pattern with a
    mixer on fla's kernels."""
    import triton

    from scripts.gpubench import cases

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    cuda = torch.device("cuda")
    assert "fla issue #640" in cases.fla_refusal("swax_gdn", cuda) and "Triton 3.6.0" in cases.fla_refusal(
        "gated_deltanet", cuda)
    assert cases.fla_refusal("swax", cuda) == cases.fla_refusal("swa", cuda) == ""  # mlstm_kernels, attention
    assert cases.fla_refusal("swax_gdn", torch.device("cpu")) == ""
    monkeypatch.setattr(triton, "__version__", "3.7.1")
    assert cases.fla_refusal("swax_gdn", cuda) == ""
