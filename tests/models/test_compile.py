"""torch.compile: masks planned outside compiled blocks, no graph breaks or unexpected recompiles for any mixer,
FlexAttention block masks built from the rules without n x n tensors, and eager flex that never falls back to
materialised scores."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

import attention.ops.flex.op as kernels
from attention.call import MixerCall
from attention.bridge import BoundaryWindows
from attention.edges import AnyOf, FixedBlock, HeadWindows, SlidingWindow
from attention.kernels import attend, plan_attention
from attention.ops.dense import dense_attention
from attention.ops.flex.block_mask import flex_block_mask
from config import ModelConfig
from conftest import run_in_process, train_in_process
from helpers import RULES, qkv
from model import GPT
from runtime.parallelize import compile_blocks

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
              pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")]


# Dynamo's graph capture (breaks, guards, recompiles) is the same whatever backend generates the code: the
# recurrent mixers' capture is checked by their aot_eager run, every other mixer's by the eager backend
RECURRENT_MIXERS = ("gated_deltanet", "mlstm")


def run_compile_check(*args):
    """python -m scripts.compile_check --device=cpu ARGS (in this process: the command's counts are what is checked,
    not its process) and the rows of its clean mixers, split into columns."""
    proc = run_in_process(["-m", "scripts.compile_check"], "--device=cpu", *args)
    return proc, [line.split() for line in proc.stdout.splitlines() if line.endswith(" ok")]


def assert_clean(proc, rows, mixers):
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert {row[0] for row in rows} == set(mixers)
    assert all(row[3] == "0" and row[4] == "0" for row in rows)  # breaks, unexpected recompiles


@pytest.mark.e2e
def test_every_mixer_compiles_without_graph_breaks_or_unexpected_recompiles():
    from attention.registry import example_cases
    from scripts.compile_check import WINDOW

    others = [name for name in example_cases(WINDOW) if name not in RECURRENT_MIXERS]
    proc, rows = run_compile_check("--backend=eager", f"--mixers={','.join(others)}")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert {row[0] for row in rows} | set(RECURRENT_MIXERS) >= {
        "full", "swa", "block", "mswa", "mswa_h", "mswa_l", "sa", "sa_swa", "swat", "linear", "mlstm", "gated_deltanet",
        "bridge", "pbb", "se_bridge", "swax", "pbb_union"}
    assert all(row[3] == "0" and row[4] == "0" for row in rows)  # breaks, unexpected recompiles
    swax = next(row for row in rows if row[0] == "swax")
    assert swax[1] == swax[2] == "5"  # swa at two windows + mlstm in training, swa + mlstm in evaluation


@pytest.mark.e2e
def test_the_recurrent_mixers_backward_compiles_through_aot_autograd():
    # the GPU check compiles every mixer with aot_eager (AOTAutograd's traced backward, no code generation): a
    # strided gate once made its backward view a gradient whose strides eager gives otherwise
    proc, rows = run_compile_check("--backend=aot_eager", f"--mixers={','.join(RECURRENT_MIXERS)}")
    assert_clean(proc, rows, RECURRENT_MIXERS)
    assert "2/2 clean" in proc.stdout


@pytest.mark.e2e
def test_inductor_compiles_the_cpu_training_path():
    # inductor's code generation on the chunked kernel (custom autograd functions) and the stochastic layout: one
    # step compiles the training forward and backward and the evaluation forward; the recompiles that later
    # steps' window switches and permutations could cause are the capture's, which the eager run checks
    proc, rows = run_compile_check("--mixers=swa,sa", "--steps=1")
    assert_clean(proc, rows, ("swa", "sa"))


def test_a_compiled_block_that_would_build_masks_in_its_graph_is_refused():
    # masks come from Mixer.plan, built by GPT.forward outside the compiled blocks; a compiled layer asked to
    # plan inside its graph must say so instead of rebuilding them at every forward
    cfg = ModelConfig(arch="llama", n_layer=1, n_head=2, n_embd=32, block_size=64, vocab_size=64, bias=False,
                      attn_pattern="swa", swa_window=8)
    layer = GPT(cfg).blocks[0].mixer
    x, pos = torch.randn(1, 64, 32), torch.arange(64)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="plan attention outside compiled code"):
        torch.compile(layer, backend="eager", fullgraph=True)(x, MixerCall(pos))
    model, compiled = GPT(cfg), GPT(cfg)
    compiled.load_state_dict(model.state_dict())  # per-block compilation keeps the state-dict keys
    compile_blocks(compiled, backend="eager")
    idx = torch.randint(0, 64, (1, 64))
    torch.testing.assert_close(compiled(idx)[0], model(idx)[0])


@pytest.mark.parametrize("rule", [*RULES, HeadWindows((64, 64, 300, 300)), SlidingWindow(129)], ids=repr)
def test_block_masks_from_the_rule_equal_create_block_mask(rule):
    for n in (64, 100, 257, 640):
        ours = flex_block_mask(rule, n, 4, "cpu")
        ref = create_block_mask(rule.mask_mod(), None, 4 if rule.per_head else None, n, n, device="cpu")
        for name in ("kv_num_blocks", "full_kv_num_blocks"):
            assert torch.equal(getattr(ours, name), getattr(ref, name).expand_as(getattr(ours, name))), (n, name)
        assert torch.equal(ours.to_dense(), ref.to_dense().expand_as(ours.to_dense())), n


def test_padded_block_mask_hides_the_padding():
    rule, n, padded = SlidingWindow(40), 200, 256
    ours = flex_block_mask(rule, padded, None, "cpu", valid=n)
    truncated = lambda b, h, q, k: (k < n) & rule.allowed(q.clamp(max=n - 1), k.clamp(max=n - 1))  # noqa: E731
    ref = create_block_mask(truncated, None, None, padded, padded, device="cpu")
    assert torch.equal(ours.to_dense(), ref.to_dense())
    assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks)


def test_block_masks_never_build_an_n_by_n_tensor():
    from helpers import LargestTensor

    n = 16384
    with LargestTensor() as seen:
        flex_block_mask(SlidingWindow(256), n, None, "cpu")
    assert seen.numel < n * n // 16  # eager create_block_mask materialises n x n


def test_eager_flex_compiles_per_head_windows_pads_to_buckets_and_fails_loudly_past_its_limit(monkeypatch):
    # evaluation and generation call flex eagerly at many lengths: one compiled kernel per padded length, and
    # past the limit an error, never a silent fallback to eager flex (which materialises (B, H, n, n) scores)
    from torch._dynamo.utils import counters

    monkeypatch.setattr(kernels, "COMPILE_EAGER_FLEX", True)
    torch._dynamo.reset()
    counters.clear()
    rule = HeadWindows((8, 8, 24, 24))  # also checks per-head windows under compiled flex (a python-int mask)
    for n in (100, 120):  # both in the 128 bucket: one compiled kernel
        q, k, v = (t.detach().float() for t in qkv(n, heads=4, dim=16, dtype=torch.float32))
        out = attend(q, k, v, rule, "flex")
        torch.testing.assert_close(out, dense_attention(q, k, v, rule, torch.arange(n)), atol=2e-5, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1
    monkeypatch.setattr(kernels, "FLEX_RECOMPILE_LIMIT", 1)
    q, k, v = (t.detach().float() for t in qkv(300, heads=4, dim=16, dtype=torch.float32))
    with pytest.raises(RuntimeError, match="would now fall back to materialising"):
        attend(q, k, v, rule, "flex")


def test_plans_are_shared_by_layers_and_redrawn_only_for_permutations():
    rule = AnyOf((FixedBlock(16), BoundaryWindows("pbb", 16, 16, 128)))
    a = plan_attention(rule, "flex", 128, 4, 16, "cpu")
    b = plan_attention(rule, "flex", 128, 4, 16, "cpu")
    assert a.data.block_mask is b.data.block_mask  # one block mask for every layer with this rule and length
    cfg = ModelConfig(arch="llama", n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=64, bias=False,
                      attn_pattern="sa", swa_window=8)
    model = GPT(cfg)
    first, second = model.plan(1, 64, "cpu"), model.plan(1, 64, "cpu")
    assert not torch.equal(first[0][0].order, second[0][0].order)  # sa: a fresh permutation per forward


@pytest.mark.e2e
def test_python_chunk_loops_are_not_compiled_at_long_lengths(tmp_path):
    cfg = ModelConfig(arch="llama", n_layer=2, n_head=2, n_embd=32, block_size=16384, vocab_size=64, bias=False,
                      attn_pattern="swax_gdn", swa_window=64)
    with torch.device("meta"):
        model = GPT(cfg)
    problems = model.compile_problems(16384, torch.device("cpu"), torch.float32)
    assert len(problems) == 1 and "256 chunks" in problems[0] and "requirements-gpu.txt" in problems[0]
    assert model.compile_problems(2048, torch.device("cpu"), torch.float32) == []
    proc = train_in_process(["configs/quickstart.py", "--arch=llama", "--bias=False", "--attn_pattern=swax",
                             "--block_size=8192", "--n_layer=2", "--n_embd=32", "--n_head=2", "--compile=True",
                             "--max_iters=1", f"--out_dir={tmp_path}"], check=False)
    assert proc.returncode == 2 and "mlstm" in proc.stderr and "compile=False" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "ckpt_last.pt").exists()


def test_flex_inside_compiled_blocks_takes_planned_masks_and_a_fresh_permutation_each_forward():
    # the CUDA training path's structure, checked where CPU inductor can (FlexAttention forward): sa's block
    # mask carries this forward's permutation into the compiled block, without recompiling for a new one
    from torch._dynamo.utils import counters

    cfg = ModelConfig(arch="llama", n_layer=2, n_head=4, n_embd=64, block_size=256, vocab_size=128, bias=False,
                      attn_pattern="sa", swa_window=32, attn_backend="flex")
    model, reference = GPT(cfg).eval(), GPT(cfg).eval()
    reference.load_state_dict(model.state_dict())
    graphs, inductor = [], torch._dynamo.lookup_backend("inductor")
    compile_blocks(model, backend=lambda gm, inputs: graphs.append(gm) or inductor(gm, inputs))
    torch._dynamo.reset()
    counters.clear()
    idx = torch.randint(0, 128, (2, 256))
    with torch.no_grad():
        for seed in (1, 2, 3):
            torch.manual_seed(seed)
            out = model(idx)[0]
            torch.manual_seed(seed)  # the same permutations, drawn by GPT.plan in the same order
            torch.testing.assert_close(out, reference(idx)[0], atol=1e-5, rtol=1e-5)
    assert len(graphs) == 1 and not counters["graph_break"]  # both layers, three permutations: one graph


def test_gpu_kernel_lookups_are_constants_under_compile():
    # On CUDA a compiled mlstm or gated_deltanet layer asks whether its GPU kernel is installed in every forward.
    # Traced, a functools.cache'd lookup is re-run (Dynamo warned of it on an H200) and a failing import in it
    # breaks the graph: the answers are constants (mlstm) or looked up when the layer is built (gated_deltanet)
    import warnings

    from attention.gated_deltanet import GatedDeltaNet
    from attention.ops.mlstm.op import triton_runs_on

    layer = GatedDeltaNet(ModelConfig(n_layer=1, n_head=2, n_embd=32, attn_pattern="gated_deltanet"), 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch._dynamo.reset()
        compiled = torch.compile(lambda x: x + int(triton_runs_on("cuda"))
                                 + int(layer.fla_kernel_for("cuda", torch.bfloat16) is None), fullgraph=True,
                                 backend="eager")
        assert compiled(torch.zeros(1)).item() == int(triton_runs_on("cuda")) + int(layer.fla is None)
    assert not [w for w in caught if "lru_cache" in str(w.message)]
