"""--cuda_graphs (docs/training.md, CUDA graphs): the blocks and the ends compiled with mode="reduce-overhead" and each
step marked. CI has no GPU: these check the setting (parsed, documented, saved, refused where it cannot work) and that
the code around it trains as compile alone does on the CPU, where inductor takes the mode and skips the graphs."""

import json

import pytest
import torch

from config import Config, ConfigError, field_help, load_config
from conftest import read_metrics, train_in_process
from runtime.parallelize import compile_options
from scripts.gpubench.cases import train_case
from scripts.gpubench.options import BenchConfig
from scripts.gpubench.timing import busy_us

TINY = ["configs/quickstart.py", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4",
        "--eval_iters=2", "--log_interval=1", "--warmup_iters=2", "--eval_interval=3", "--max_iters=3"]


def test_the_setting_is_parsed_and_its_help_says_when_it_pays():
    assert Config().train.cuda_graphs is False
    cfg = load_config(["--compile=True", "--cuda_graphs=True", "--gradient_accumulation_steps=1"])
    assert cfg.train.cuda_graphs is True and cfg.to_dict()["train"]["cuda_graphs"] is True
    help_text = field_help(type(cfg.train))["cuda_graphs"]
    assert "reduce-overhead" in help_text and "host bounds the step" in help_text


@pytest.mark.parametrize("args, expected", [
    (["--cuda_graphs=True"], "needs compile=True: add --compile=True"),
    (["--cuda_graphs=True", "--compile=True", "--parallelism=fsdp"], "use --parallelism=ddp, or --cuda_graphs=False"),
])
def test_what_cannot_work_is_refused_with_the_fix(args, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(args)


def test_an_old_runs_config_without_the_setting_reads_as_off():
    saved = Config().to_dict()
    del saved["train"]["cuda_graphs"]
    assert Config.from_dict(saved).train.cuda_graphs is False


def test_the_mode_goes_to_inductor_but_not_to_the_cpu_standing_in_for_cuda(monkeypatch):
    cfg = load_config(["--compile=True", "--cuda_graphs=True"])
    cpu = torch.device("cpu")
    assert compile_options(cfg.train, cpu) == {"mode": "reduce-overhead"}  # inductor takes it; skips graphs on CPU
    monkeypatch.setenv("EFFICIENT_ATTENTION_SIMULATE_CUDA", "1")
    assert compile_options(cfg.train, cpu) == {}  # aot_eager takes no mode (torch.compile refuses both)
    cfg.train.cuda_graphs = False
    monkeypatch.delenv("EFFICIENT_ATTENTION_SIMULATE_CUDA")
    assert compile_options(cfg.train, cpu) == {}


def test_the_gpu_benchmark_counts_overlapping_kernels_once_and_refuses_graphs_without_compiling(tmp_path):
    assert busy_us([]) == 0.0
    assert busy_us([(10, 20), (0, 5), (15, 30), (40, 41)]) == 5 + 20 + 1  # 10-30 overlapping: once
    with pytest.raises(ConfigError, match="add --train_compile=True"):
        train_case("full", BenchConfig(device="cpu", train_cuda_graphs=True, train_compile=False), tmp_path)


@pytest.mark.e2e
@pytest.mark.parametrize("args, expected", [
    (["--cuda_graphs=True"], "needs compile=True"),
    (["--cuda_graphs=True", "--compile=True", "--gradient_accumulation_steps=2"],
     "--gradient_accumulation_steps=1 (one micro-batch per process) with a --batch_size 2 times larger"),
])
def test_train_refuses_with_exit_2_and_writes_nothing(tmp_path, args, expected):
    proc = train_in_process([*TINY, *args, f"--out_dir={tmp_path / 'run'}"], check=False)
    assert proc.returncode == 2 and expected in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_a_compiled_cpu_run_with_cuda_graphs_trains_as_without(tmp_path):
    """On the CPU inductor skips CUDA graphs: the same kernels, so the same losses to the bit (the step marks and
    StepMarked's evaluation change nothing else). The two compilations run one after the other: about 40 s on 2
    cores."""
    runs = {}
    for graphs in (False, True):
        out = tmp_path / str(graphs)
        proc = train_in_process([*TINY, "--compile=True", f"--cuda_graphs={graphs}", f"--out_dir={out}"])
        runs[graphs] = out
        assert ("cuda_graphs=True: no CUDA graphs here (inductor skips them on cpu" in proc.stdout) == graphs
    assert read_metrics(runs[True]) == read_metrics(runs[False]) and len(read_metrics(runs[True])) == 3
    assert read_metrics(runs[True], "val_loss") == read_metrics(runs[False], "val_loss")
    assert json.loads((runs[True] / "config.json").read_text())["train"]["cuda_graphs"] is True


@pytest.mark.e2e
def test_a_run_saved_before_the_setting_resumes_unchanged(tmp_path):
    """A checkpoint and config.json without cuda_graphs (written before it existed) resume with it off, silently."""
    first = train_in_process([*TINY, "--max_iters=2", "--eval_interval=2", f"--out_dir={tmp_path}"])
    assert first.returncode == 0
    config = json.loads((tmp_path / "config.json").read_text())
    del config["train"]["cuda_graphs"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    ckpt = torch.load(tmp_path / "ckpt_last.pt", weights_only=False)
    del ckpt["config"]["train"]["cuda_graphs"]
    torch.save(ckpt, tmp_path / "ckpt_last.pt")
    proc = train_in_process([str(tmp_path / "config.json"), "--init_from=resume", "--max_iters=4"])
    assert "unknown saved config key" not in proc.stderr and "cuda_graphs" not in proc.stdout
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["train"]["cuda_graphs"] is False and sorted(read_metrics(tmp_path)) == [1, 2, 3, 4]
    assert "train.cuda_graphs" not in saved["invocations"][-1].get("changed", {})


@pytest.mark.e2e
def test_the_cpu_standing_in_for_cuda_trains_with_it_and_says_it_records_no_graphs(tmp_path, monkeypatch):
    """The simulated CUDA path compiles with aot_eager, which takes no mode: the run passes none, marks its steps as
    on a GPU, and says so in one line."""
    monkeypatch.setenv("EFFICIENT_ATTENTION_SIMULATE_CUDA", "1")
    proc = train_in_process([*TINY, "--compile=True", "--cuda_graphs=True", f"--out_dir={tmp_path}"], check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no CUDA graphs here (the CPU standing in for CUDA compiles with aot_eager" in proc.stdout
    assert sorted(read_metrics(tmp_path)) == [1, 2, 3]
