"""SWAX (paper 003): the layer pattern, the per-step window schedule (reproducible, p, annealing, resume,
no recompilation when the window switches), test-time windows, constant-memory generation."""

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

from attention import layer_names
from attention.cache import state_bytes
from conftest import TINY, run_in_process, train_in_process
from config import ModelConfig
from model import GPT
from training.schedules import window_for_step


def run(args, out_dir, check=True):
    """python train.py (in this process: the process itself is not what these tests check): the tiny model of the
    training tests (dropout on, the rate decaying over 12 steps)."""
    return train_in_process([*TINY, "--lr_decay_iters=12", "--dropout=0.1", f"--out_dir={out_dir}", *args],
                            check=check)


def schedule(**kw):
    t = dict(window_schedule="stochastic", swax_short_window=128, swax_short_prob=0.5, swax_anneal_frac=0.1,
             max_iters=20_000, seed=1337)
    t.update(kw)
    return SimpleNamespace(**t)


def windows(t, long_window=2048):
    return [window_for_step(step, t, long_window) for step in range(t.max_iters)]


@pytest.mark.parametrize("p", [0.5, 0.75])
def test_stochastic_windows_respect_p_and_the_annealing_fraction(p):
    t = schedule(swax_short_prob=p)
    drawn = windows(t)
    assert set(drawn) == {128, 2048}
    stochastic_part = drawn[:18_000]
    short = stochastic_part.count(128) / len(stochastic_part)
    assert abs(short - p) < 4 * math.sqrt(p * (1 - p) / len(stochastic_part))  # within 4 standard errors
    assert set(drawn[18_000:]) == {2048}  # the last 10%: the long window only
    assert 128 in drawn[17_900:18_000]  # and not earlier


def test_windows_are_reproducible_per_seed_and_fixed_means_fixed():
    assert windows(schedule(max_iters=500)) == windows(schedule(max_iters=500))
    assert windows(schedule(max_iters=500)) != windows(schedule(max_iters=500, seed=1))
    assert set(windows(schedule(max_iters=500, window_schedule="fixed"))) == {2048}
    assert set(windows(schedule(max_iters=500, swax_short_prob=1.0, swax_anneal_frac=0.0))) == {128}


def test_swax_alias_alternates_swa_and_the_recurrent_mixer():
    assert layer_names(ModelConfig(n_layer=4, attn_pattern="swax")) == ["swa", "mlstm"] * 2
    assert layer_names(ModelConfig(n_layer=4, attn_pattern="mlstm,swa")) == ["mlstm", "swa"] * 2
    assert layer_names(ModelConfig(n_layer=6, attn_pattern="swa,swa,mlstm")) == ["swa", "swa", "mlstm"] * 2
    assert layer_names(ModelConfig(n_layer=4, attn_pattern="swax_gdn")) == ["swa", "gated_deltanet"] * 2


def swax(**kw):
    cfg = dict(arch="llama", n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=64, bias=False,
               attn_pattern="swax", swa_window=32, mlstm_chunk=16)
    cfg.update(kw)
    torch.manual_seed(0)
    return GPT(ModelConfig(**cfg))


@pytest.mark.parametrize("options, layers", [({}, 1), ({"attn_pattern": "swat", "swat_bias": "-log(w)"}, 2)])
def test_set_window_equals_a_model_built_with_that_window(options, layers):
    model = swax(**options).eval()
    other = swax(swa_window=8, **options).eval()
    other.load_state_dict(model.state_dict())
    idx = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(0))
    assert model.set_window(8) == layers  # swax: one swa layer (the mlstm layer has no window)
    torch.testing.assert_close(model(idx)[0], other(idx)[0])  # swat: b = -log(8) follows the window
    assert GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64)).set_window(8) == 0


def test_switching_windows_under_torch_compile_traces_each_window_once():
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = swax()
    compiled = torch.compile(model, backend=counting_backend)
    idx = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(0))
    counts = []
    for window in [32, 8, 32, 8, 8, 32]:
        model.set_window(window)
        loss = compiled(idx, idx)[1]
        loss.backward()
        counts.append(len(graphs))
        torch.testing.assert_close(loss, model(idx, idx)[1])  # the compiled model follows the new window
    assert counts[1] == counts[-1]  # after both windows were seen, switching never traces again


@pytest.mark.e2e
def test_stochastic_training_logs_its_windows_and_resumes_exactly(tmp_path):
    args = ["--attn_pattern=swax", "--arch=llama", "--swa_window=16", "--window_schedule=stochastic",
            "--swax_short_window=4", "--swax_short_prob=0.5", "--eval_interval=4"]

    def logged(out, key):
        records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        return {r["step"]: r[key] for r in records if key in r}

    reference = tmp_path / "reference"
    run([*args, "--max_iters=12", "--swax_anneal_frac=0.25"], reference)
    t = schedule(swax_short_window=4, max_iters=12, swax_anneal_frac=0.25)
    expected = {step + 1: w for step, w in enumerate(windows(t, long_window=16))}
    assert logged(reference, "window") == expected
    assert {expected[s] for s in (10, 11, 12)} == {16} and 4 in expected.values()

    # interrupted after 6 steps and resumed: the same windows and the same losses as one uninterrupted run
    # (no annealing: its last fraction follows each command's max_iters)
    uninterrupted, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    run([*args, "--max_iters=12", "--swax_anneal_frac=0"], uninterrupted)
    run([*args, "--max_iters=6", "--swax_anneal_frac=0", "--ckpt_interval=3"], resumed)
    run([*args, "--max_iters=12", "--swax_anneal_frac=0", "--init_from=resume"], resumed)
    assert logged(resumed, "window") == logged(uninterrupted, "window")
    assert logged(resumed, "train_loss") == logged(uninterrupted, "train_loss")

    # the drawn window is the one the layers used: the same losses as fixed-window training up to the first
    # short-window step, and a different one there
    fixed = tmp_path / "fixed"
    run([*args, "--max_iters=12", "--window_schedule=fixed"], fixed)
    windows_drawn, stochastic_loss, fixed_loss = logged(uninterrupted, "window"), logged(uninterrupted, "train_loss"), \
        logged(fixed, "train_loss")
    first_short = min(step for step, w in windows_drawn.items() if w == 4)
    for step in range(1, first_short):
        assert stochastic_loss[step] == fixed_loss[step]
    assert stochastic_loss[first_short] != fixed_loss[first_short]

    # sampling with a test-time window; a model without sliding-window layers refuses one
    sample = ["--window=4", "--temperature=0", "--max_new_tokens=8", "--num_samples=1"]
    proc = run_in_process(["sample.py"], *sample, f"--out_dir={reference}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    run(["--max_iters=1"], tmp_path / "full")
    proc = run_in_process(["sample.py"], *sample, f"--out_dir={tmp_path / 'full'}")
    assert proc.returncode == 2 and "no sliding-window layers" in proc.stderr


@pytest.mark.parametrize("bad, message", [
    (["--window_schedule=stochastic", "--attn_pattern=full"], "has none"),
    (["--window_schedule=stochastic", "--attn_pattern=swax", "--swa_window=16", "--swax_short_window=16"],
     "must be smaller than swa_window"),
    (["--swax_short_prob=1.5"], "must be in"),
])
@pytest.mark.e2e
def test_schedule_errors_exit_2(tmp_path, bad, message):
    proc = run(["--arch=llama", "--max_iters=1", *bad], tmp_path / "out", check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out" / "ckpt_last.pt").exists()


def generation_state(model, context: int):
    """The layers' state after a prompt of `context` tokens and 4 generated ones, as generate() keeps it."""
    idx = torch.randint(0, 64, (1, context), generator=torch.Generator().manual_seed(0))
    caches = model.init_caches(1, context + 4)
    model(idx, caches=caches)
    for t in range(context, context + 4):
        model(idx[:, -1:], caches=caches, start_pos=t)
    return state_bytes(caches)


def test_generation_memory_is_flat_in_context_length_for_swax_and_grows_for_full():
    with torch.no_grad():
        hybrid = swax(block_size=1024).eval()
        full = swax(block_size=1024, attn_pattern="full").eval()
        assert generation_state(hybrid, 128) == generation_state(hybrid, 1024)
        assert generation_state(full, 1024) > 6 * generation_state(full, 128)


def test_paper_configs_have_the_papers_settings():
    from config import load_config

    def params(cfg):
        with torch.device("meta"):
            return GPT(cfg.model).num_params()

    small = load_config(["configs/swax/swax_1p4b_stochastic.py"])
    m, t = small.model, small.train
    assert (m.n_layer, m.n_embd, m.n_head, m.block_size, m.rope_theta) == (24, 2048, 16, 16384, 10000.0)
    assert layer_names(m)[:2] == ["swa", "mlstm"] and m.arch == "llama"  # gated SiLU MLP
    assert t.batch_size * t.gradient_accumulation_steps * m.block_size == 2 ** 20  # 1M-token batches
    assert (t.learning_rate, t.min_lr) == (3e-4, 3e-6)
    assert (t.window_schedule, t.swax_short_window, m.swa_window, t.swax_short_prob, t.swax_anneal_frac) == \
        ("stochastic", 128, 2048, 0.5, 0.1)
    assert abs(params(small) / 1.4e9 - 1) < 0.02
    for w in (128, 256, 512, 1024, 2048):
        fixed = load_config([f"configs/swax/swax_1p4b_w{w}.py"])
        assert fixed.model.swa_window == w and fixed.train.window_schedule == "fixed"
    assert set(layer_names(load_config(["configs/swax/swax_1p4b_xlstm.py"]).model)) == {"mlstm"}
    assert set(layer_names(load_config(["configs/swax/swax_1p4b_swa_w128.py"]).model)) == {"swa"}
    assert layer_names(load_config(["configs/swax/swax_gdn_1p4b_stochastic.py"]).model)[:2] == ["swa", "gated_deltanet"]
    large = load_config(["configs/swax/swax_7b_stochastic.py"])
    assert (large.model.n_layer, large.model.n_embd, large.train.swax_short_prob) == (32, 4096, 0.75)
    assert large.train.batch_size * large.train.gradient_accumulation_steps * large.model.block_size == 2 ** 20
    assert 6.5e9 < params(large) < 7.2e9
