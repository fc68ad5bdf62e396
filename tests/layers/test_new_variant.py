"""A new attention variant is one file: a module dropped into attention/ (here a copy of the repository's, with no
other file edited) is trained, sampled with its cache, benchmarked, compile-checked, memory-planned, counted,
run inside a small Hugging Face model, run on the CUDA path simulated on the CPU, and its kernels equal the dense
reference forward and backward without an n x n tensor on the training path: everything through the registry."""

import json
import os
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


@pytest.mark.e2e
def test_a_variant_in_one_new_file_reaches_every_tool(repo_with_variant, tmp_path):
    copy = repo_with_variant
    tiny = ["configs/quickstart.py", "--attn_pattern=sinkwin", "--n_layer=2", "--n_head=2", "--n_embd=32",
            "--block_size=64", "--swa_window=16", "--sink_keys=2", "--batch_size=4", "--max_iters=4",
            "--eval_interval=4", "--eval_iters=2", "--log_interval=2", "--warmup_iters=1"]
    out = tmp_path / "run"
    run(copy, "train.py", *tiny, f"--out_dir={out}")  # its setting on the command line, in config.json
    assert json.loads((out / "config.json").read_text())["model"]["sink_keys"] == 2
    bad = subprocess.run([sys.executable, "train.py", *tiny, "--sink_key=2", f"--out_dir={tmp_path / 'x'}"],
                         cwd=copy, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "did you mean 'sink_keys'" in bad.stderr
    bad = subprocess.run([sys.executable, "train.py", *tiny, "--sink_keys=0", f"--out_dir={tmp_path / 'x'}"],
                         cwd=copy, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "sink_keys=0: must be >= 1" in bad.stderr
    assert "loaded" in run(copy, "sample.py", f"--out_dir={out}", "--max_new_tokens=8", "--num_samples=1").stderr
    run(copy, "train.py", *tiny, "--attn_pattern=swa", f"--out_dir={tmp_path / 'swa'}")
    table = run(copy, "-m", "scripts.compare", str(out), str(tmp_path / "swa")).stdout  # its setting is a column
    assert "| sinkwin " in table and "sink_keys" in table.splitlines()[2]
    bench = run(copy, "-m", "scripts.bench_attention", "--variants=swa,sinkwin", "--lengths=512", "--repeats=1",
                "--window=64").stdout
    assert "sinkwin" in bench and "chunked" in bench
    assert "1/1 clean" in run(copy, "-m", "scripts.compile_check", "--mixers=sinkwin", "--backend=eager",
                               "--device=cpu").stdout
    plan = run(copy, "-m", "scripts.plan_memory", "configs/quickstart.py", "--attn_pattern=sinkwin", "--kernels=cpu",
               "--world_size=1").stdout
    assert "SinkWindowAttention" in plan
    stats = json.loads(run(copy, "-m", "scripts.mask_stats", "--config", "configs/quickstart.py", "--seq_len", "256",
                           "--attn_pattern=sinkwin", "--swa_window=32", "--sink_keys=4", "--json").stdout)
    # per query: the window (32, fewer at the start) and the sinks beyond it
    assert stats["layers"][0]["edges_per_head"] == sum(min(q + 1, 32) + max(0, min(4, q + 1 - 32)) for q in range(256))
    # the checks import tests/helpers.py, which imports conftest, by name as pytest does: tests/ on the import path
    assert "checks passed" in run(copy, "-c", CHECKS, env={**os.environ, "PYTHONPATH": "tests"}).stdout
    # the CUDA path, simulated on the CPU (tests/models/test_gpu_sim.py): FlexAttention under its block masks,
    # compiled, forward and backward against dense; bf16 autocast, bf16 weights, bf16 cached generation
    simulated = run(copy, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/models/test_gpu_sim.py", "-k",
                    "sinkwin")
    assert "5 passed" in simulated.stdout, simulated.stdout[-2000:]
    # inside a small Hugging Face model
    folder, data = (tmp_path / "hf" / "tiny-qwen3", tmp_path / "hf" / "corpus_tok")
    run(copy, "-c", "from pathlib import Path; from scripts.gpucheck.tiny_hf import build_tiny_hf_model; "
                    f"build_tiny_hf_model(Path({str(tmp_path / 'hf')!r}))")
    run(copy, "-m", "eval", f"--hf={folder}", f"--data_dir={data}", "--attn_pattern=sinkwin", "--swa_window=16",
        "--sink_keys=2", "--tasks=ppl", "--ppl_lengths=64", "--limit=2", "--progress=False",
        f"--out_dir={tmp_path / 'hf_eval'}")
    assert (tmp_path / "hf_eval" / "eval" / "ppl.json").exists()
    # nothing else to edit: the README's variant table lists the documented variants, and this one has no summary
    run(copy, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/runs/test_config.py", "-k", "variant_table")
    # the project itself does not know it
    assert not (REPO / "attention" / "sinkwin.py").exists()
