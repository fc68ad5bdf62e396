"""A new attention variant is one file: a module dropped into attention/ (here a copy of the repository's, with no
other file edited) is trained, sampled with its cache, benchmarked, compile-checked, memory-planned, counted,
run inside a small Hugging Face model, run on the CUDA path simulated on the CPU, and its kernels equal the dense
reference forward and backward without an n x n tensor on the training path: everything through the registry."""

import json
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

# the whole variant, as docs/adding_a_variant.md shows it (its first python block, under "## One file"): a rule
# with unbounded lookback (a window plus a few global keys, which its key_ranges name), a registered mixer, and
# one setting of its own with a check. The test runs the doc's code, so the doc stays true.
DOC = REPO / "docs" / "adding_a_variant.md"
VARIANT = DOC.read_text().split("## One file", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]

# run inside the copy: the kernels against dense (forward and backward), cached generation, no n x n tensor
CHECKS = '''
import torch
from attention.kernels import attend
from attention.ops.dense import dense_attention
from attention.registry import MIXERS
from config import ModelConfig
from model import GPT
from helpers import LargestTensor

rule = MIXERS["sinkwin"](ModelConfig(n_layer=1, n_head=2, n_embd=32, swa_window=16, sink_keys=3,
                                     attn_pattern="sinkwin"), 0).rule
assert rule.lookback is None
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, 2, 100, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
probe = torch.randn(2, 2, 100, 16, generator=g, dtype=torch.float64)
ref = dense_attention(q, k, v, rule, torch.arange(100))
ref_grads = torch.autograd.grad(ref, (q, k, v), probe)
for backend in ("chunked", "auto"):
    out = attend(q, k, v, rule, backend)
    torch.testing.assert_close(out, ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), probe), ref_grads):
        torch.testing.assert_close(a, b)
with torch.no_grad():
    torch.testing.assert_close(attend(q.float(), k.float(), v.float(), rule, "flex"), ref.float(), atol=1e-5, rtol=1e-4)
torch.manual_seed(0)
model = GPT(ModelConfig(arch="llama", n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=61, bias=False,
                        attn_pattern="sinkwin", swa_window=8, sink_keys=2)).eval()
prompt = torch.randint(0, 61, (2, 20))
assert torch.equal(model.generate(prompt, 30, temperature=0, use_cache=True),
                   model.generate(prompt, 30, temperature=0, use_cache=False))
n = 8192
layer = MIXERS["sinkwin"](ModelConfig(n_layer=1, n_head=1, n_embd=16, block_size=n, swa_window=128, sink_keys=4,
                                      attn_pattern="sinkwin"), 0)
x = [torch.randn(1, 1, n, 16, requires_grad=True) for _ in range(3)]
with LargestTensor() as largest:
    layer.kernel_forward(*x).sum().backward()
assert largest.numel < n * n // 16 and sum(size >= n for size in largest.shape) <= 1, largest.shape
print("checks passed")
'''


@pytest.fixture(scope="module")
def repo_with_variant(tmp_path_factory):
    """A copy of the repository with attention/sinkwin.py added and nothing else changed."""
    copy = tmp_path_factory.mktemp("repo") / "repo"
    ignore = shutil.ignore_patterns(".git", "out", "wandb", "__pycache__", "*.bin", "meta.json", ".tmp*", ".pytest_cache")
    shutil.copytree(REPO, copy, ignore=ignore)
    (copy / "attention" / "sinkwin.py").write_text(VARIANT)
    return copy


def run(copy, *args, timeout=600, env=None):
    proc = subprocess.run([sys.executable, *args], cwd=copy, capture_output=True, text=True, timeout=timeout,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


# The tools (and pytest on the copy's own tests) run one after the other in one fresh process of the copy (the
# copy's modules, not this process's), each as `python TOOL ARGS` runs it: the copy's own conftest.run_in_process
# (its file or module as __main__, output and exit status captured, the process put back between tools). Python
# starts once instead of once per tool. tests/ is on the import path, as pytest puts it, for conftest and for
# CHECKS's helpers.
DRIVER = """
import json, os, sys
sys.path.insert(0, os.path.abspath("tests"))
from conftest import run_in_process
done = [run_in_process(command, *args) for command, args in json.loads(sys.argv[1])]
print(json.dumps([[p.returncode, p.stdout, p.stderr] for p in done]))
"""


def run_tools(copy, *commands) -> list:
    """(returncode, stdout, stderr) of each (command, args) run in one process of the copy (DRIVER)."""
    proc = run(copy, "-c", DRIVER, json.dumps(commands), timeout=900)
    return [subprocess.CompletedProcess([*command, *args], *result)
            for (command, args), result in zip(commands, json.loads(proc.stdout.strip().splitlines()[-1]))]


def succeeded(proc):
    assert proc.returncode == 0, (proc.args, proc.stdout[-3000:] + proc.stderr[-3000:])
    return proc


@pytest.mark.e2e
def test_a_variant_in_one_new_file_reaches_every_tool(repo_with_variant, tmp_path):
    copy = repo_with_variant
    tiny = ["configs/quickstart.py", "--attn_pattern=sinkwin", "--n_layer=2", "--n_head=2", "--n_embd=32",
            "--block_size=64", "--swa_window=16", "--sink_keys=2", "--batch_size=4", "--max_iters=4",
            "--eval_interval=4", "--eval_iters=2", "--log_interval=2", "--warmup_iters=1"]
    swa_args = [*(arg for arg in tiny if arg != "--sink_keys=2"), "--attn_pattern=swa"]  # another variant beside it
    out = tmp_path / "run"
    (tmp_path / "checks.py").write_text(CHECKS)
    (tmp_path / "tiny_hf.py").write_text("from pathlib import Path; from scripts.gpucheck.tiny_hf import "
                                         f"build_tiny_hf_model; build_tiny_hf_model(Path({str(tmp_path / 'hf')!r}))")
    folder, data = (tmp_path / "hf" / "tiny-qwen3", tmp_path / "hf" / "corpus_tok")
    (trained, *bad, sampled, swa, compared, bench, compiled, plan, stats, checks, hf, hf_eval, simulated,
     variant_table) = run_tools(
        copy,
        (["train.py"], [*tiny, f"--out_dir={out}"]),  # its setting on the command line, in config.json
        (["train.py"], [*tiny, "--sink_key=2", f"--out_dir={tmp_path / 'x'}"]),
        (["train.py"], [*tiny, "--sink_keys=0", f"--out_dir={tmp_path / 'x'}"]),
        (["sample.py"], [f"--out_dir={out}", "--max_new_tokens=8", "--num_samples=1"]),
        (["train.py"], [*swa_args, f"--out_dir={tmp_path / 'swa'}"]),
        (["-m", "scripts.compare"], [str(out), str(tmp_path / "swa")]),
        (["-m", "scripts.bench_attention"], ["--variants=swa,sinkwin", "--lengths=512", "--repeats=1", "--window=64"]),
        (["-m", "scripts.compile_check"], ["--mixers=sinkwin", "--backend=eager", "--device=cpu"]),
        (["-m", "scripts.plan_memory"], ["configs/quickstart.py", "--attn_pattern=sinkwin", "--kernels=cpu",
                                         "--world_size=1"]),
        (["-m", "scripts.mask_stats"], ["--config", "configs/quickstart.py", "--seq_len", "256",
                                        "--attn_pattern=sinkwin", "--swa_window=32", "--sink_keys=4", "--json"]),
        # the kernels against dense, cached generation, no n x n tensor: CHECKS, which imports tests/helpers.py
        ([str(tmp_path / "checks.py")], []),
        ([str(tmp_path / "tiny_hf.py")], []),  # inside a small Hugging Face model
        (["-m", "eval"], [f"--hf={folder}", f"--data_dir={data}", "--attn_pattern=sinkwin", "--swa_window=16",
                          "--sink_keys=2", "--tasks=ppl", "--ppl_lengths=64", "--limit=2", "--progress=False",
                          f"--out_dir={tmp_path / 'hf_eval'}"]),
        # the CUDA path, simulated on the CPU (tests/models/test_gpu_sim.py): FlexAttention under its block masks,
        # compiled, forward and backward against dense; bf16 autocast, documents, bf16 weights, bf16 cached generation
        (["-m", "pytest"], ["-q", "-p", "no:cacheprovider", "tests/models/test_gpu_sim.py", "-k", "sinkwin"]),
        # nothing else to edit: the README's variant table lists the documented variants, and this one has no summary
        (["-m", "pytest"], ["-q", "-p", "no:cacheprovider", "tests/runs/test_config.py", "-k", "variant_table"]))
    succeeded(trained)
    assert json.loads((out / "config.json").read_text())["model"]["sink_keys"] == 2
    assert bad[0].returncode == 2 and "did you mean 'sink_keys'" in bad[0].stderr
    assert bad[1].returncode == 2 and "sink_keys=0: must be >= 1" in bad[1].stderr
    assert "loaded" in succeeded(sampled).stderr
    succeeded(swa)
    table = succeeded(compared).stdout  # its setting is a column
    assert "| sinkwin " in table and "sink_keys" in table.splitlines()[2]
    bench = succeeded(bench).stdout
    assert "sinkwin" in bench and "chunked" in bench
    assert "1/1 clean" in succeeded(compiled).stdout
    assert "SinkWindowAttention" in succeeded(plan).stdout
    stats = json.loads(succeeded(stats).stdout)
    # per query: the window (32, fewer at the start) and the sinks beyond it
    assert stats["layers"][0]["edges_per_head"] == sum(min(q + 1, 32) + max(0, min(4, q + 1 - 32)) for q in range(256))
    assert "checks passed" in succeeded(checks).stdout
    succeeded(hf)
    succeeded(hf_eval)
    assert (tmp_path / "hf_eval" / "eval" / "ppl.json").exists()
    # the registry case's three tests there: compiled in float32 and bf16 autocast, with documents, bf16 weights
    assert "3 passed" in succeeded(simulated).stdout, simulated.stdout[-2000:]
    succeeded(variant_table)
    # the project itself does not know it
    assert not (REPO / "attention" / "sinkwin.py").exists()
