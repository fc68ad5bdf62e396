"""scripts/plan_memory.py: its activation estimate against the tensors autograd really keeps for backward (small
CPU models), the numbers its command line prints, and the paper recipes' fit on 80 GB GPUs."""

import json
import subprocess
import sys

import pytest
import torch

from config import ModelConfig
from conftest import REPO
from model import GPT
from runtime.parallelize import apply_activation_checkpointing
from runtime.memory_plan import GIB, Kernels, PlanOptions, block_activations, head_saved, plan

SMALL = dict(arch="llama", n_layer=2, n_head=4, n_embd=96, block_size=256, bias=False, dropout=0.0, vocab_size=320,
             swa_window=32, block_len=32, bridge_width=32, bridge_extension=16)
CASES = {  # name: the model's differences from SMALL
    "full": {"attn_pattern": "full"},
    "swa": {"attn_pattern": "swa", "n_embd": 128, "block_size": 512},
    "sa": {"attn_pattern": "sa"},
    "sa_swa": {"attn_pattern": "sa_swa"},
    "mswa": {"attn_pattern": "mswa", "n_layer": 4},
    "pbb": {"attn_pattern": "pbb"},
    "swat": {"attn_pattern": "swat"},
    "swax": {"attn_pattern": "swax"},  # swa, mlstm
    "gated_deltanet": {"attn_pattern": "gated_deltanet"},
    "linear": {"attn_pattern": "linear"},
    "moba": {"attn_pattern": "moba", "moba_block": 32},
    "gpt2_full": {"arch": "gpt2", "bias": True, "attn_pattern": "full"},
}
BATCH = 2


def small_model(name: str) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(**{**SMALL, **CASES[name]}))


def saved_for_backward(model: GPT, autocast: bool = False) -> tuple[list[int], int]:
    """Bytes autograd keeps after one forward: every saved tensor's storage counted once (many saved tensors are
    views of one storage), parameters and autocast's copies of them excluded (the plan counts those as weights).
    Returns the bytes first saved inside each block, and the rest (embedding, final norm, head, loss)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape[::-1]) for p in model.parameters()}
    owner, seen = ["outside"], {}

    def enter(index):
        def hook(module, args):
            owner.append(index)
        return hook

    def leave(module, args, output):
        owner.pop()

    hooks = [hook for i, block in enumerate(model.blocks)
             for hook in (block.register_forward_pre_hook(enter(i)), block.register_forward_hook(leave))]

    def pack(t):
        storage = t.untyped_storage()
        weight_copy = (t.dtype == torch.bfloat16 and tuple(t.shape) in weight_shapes
                       and storage.nbytes() == 2 * t.numel())
        if storage.data_ptr() not in params and not weight_copy:
            seen.setdefault(storage.data_ptr(), (owner[-1], storage.nbytes()))
        return t

    idx = torch.randint(0, model.config.vocab_size, (BATCH, model.config.block_size + 1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(idx[:, :-1], idx[:, 1:])
    for hook in hooks:
        hook.remove()
    per_block = [sum(size for where, size in seen.values() if where == i) for i in range(len(model.blocks))]
    return per_block, sum(size for where, size in seen.values() if where == "outside")


def assert_close(estimated: int, measured: int, what: str, tolerance: float = 0.2):
    assert abs(estimated - measured) <= tolerance * measured, \
        f"{what}: estimated {estimated:,} bytes, measured {measured:,} ({estimated / measured - 1:+.1%})"


@pytest.mark.parametrize("name", CASES)
def test_activation_estimate_matches_the_tensors_saved_for_backward(name):
    model = small_model(name)
    m, kernels = model.config, Kernels("cpu", 4)  # float32 on the CPU kernels (chunked, ChunkedFlashCPU)
    per_block, outside = saved_for_backward(model)
    layers = [block_activations(block, m, kernels, BATCH, m.block_size) for block in model.blocks]
    for i, (layer, measured) in enumerate(zip(layers, per_block)):
        assert_close(layer.total, measured, f"{name} block {i} ({layer.mixer})")
    head = sum(head_saved(m, kernels, BATCH, m.block_size, loss_chunk=0).values())
    assert_close(head, outside, f"{name} final norm, head and loss")
    assert_close(sum(layer.total for layer in layers) + head, sum(per_block) + outside, f"{name} in all")


@pytest.mark.parametrize("name", ["swa", "sa_swa", "swax", "gated_deltanet", "linear", "gpt2_full"])
def test_bf16_autocast_estimate_matches_the_tensors_saved_for_backward(name):
    # autocast casts the float32 input of every linear layer on its own and returns bf16: the GPU's accounting
    model = small_model(name)
    m, kernels = model.config, Kernels("cpu", 2)
    per_block, outside = saved_for_backward(model, autocast=True)
    estimated = sum(block_activations(block, m, kernels, BATCH, m.block_size).total for block in model.blocks)
    estimated += sum(head_saved(m, kernels, BATCH, m.block_size, loss_chunk=0).values())
    assert_close(estimated, sum(per_block) + outside, f"{name} under bf16 autocast")


@pytest.mark.parametrize("name", ["swa", "sa_swa", "swax", "gated_deltanet"])
def test_full_checkpointing_keeps_only_the_block_inputs(name):
    # through the forward each checkpointed block keeps its input (and positions), saved by the checkpoint;
    # its activations (the amount the first test checks) are recomputed in backward, one block at a time
    model = small_model(name)
    m, kernels = model.config, Kernels("cpu", 4)
    apply_activation_checkpointing(model, "full")
    per_block, outside = saved_for_backward(model)
    layers = [block_activations(block, m, kernels, BATCH, m.block_size) for block in model.blocks]
    for i, (layer, measured) in enumerate(zip(layers, per_block)):
        assert_close(layer.kept("full"), measured, f"{name} block {i} with full checkpointing")
    head = sum(head_saved(m, kernels, BATCH, m.block_size, loss_chunk=0).values())
    assert_close(sum(layer.kept("full") for layer in layers) + head, sum(per_block) + outside,
                 f"{name} with full checkpointing, in all")


def run_plan(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scripts.plan_memory", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.e2e
def test_command_line_breakdown_adds_up_and_fits_keep_the_global_batch(tmp_path):
    out = tmp_path / "plan.json"
    # the recipe under DDP with selective checkpointing (it ships sharded, without checkpointing)
    proc = run_plan("configs/swax/swax_1p4b_stochastic.py", "--parallelism=ddp", "--activation_checkpointing=selective",
                    "--gpu_mem_gb=80", "--world_size=8", f"--json={out}")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    c = r["configured"]
    assert c["batch_size"] == r["batch_size"] == 1 and c["activation_checkpointing"] == "selective"
    assert sum(c["breakdown_gib"].values()) == pytest.approx(c["total_gib"], rel=1e-9)
    assert f"{c['total_gib']:.2f}" in proc.stdout and r["configured_fits"]
    static = c["static_gib"]
    assert static["weights (fp32)"] == static["gradients (fp32)"] == static["DDP gradient buckets (fp32)"] \
        == pytest.approx(4 * r["n_params"] / GIB)
    assert static["AdamW exp_avg + exp_avg_sq (fp32)"] == pytest.approx(8 * r["n_params"] / GIB)
    assert static["autocast bf16 weight copies"] == pytest.approx(2 * r["n_cast"] / GIB)
    assert r["global_tokens"] == 1_048_576 and r["budget_gib"] == pytest.approx(72.0)
    fits = {(f["activation_checkpointing"], f["loss_chunk"]): f for f in r["fits"]}
    assert fits["none", 0]["batch_size"] is None and fits["none", 0]["total_gib"] > 72  # not even one sequence
    for fit in r["fits"]:
        if fit["batch_size"] is not None:
            assert fit["batch_size"] * fit["gradient_accumulation_steps"] == r["global_sequences"]
            assert fit["gradient_accumulation_steps"] % 8 == 0 and fit["total_gib"] <= r["budget_gib"]
    # full checkpointing keeps less per sequence than selective, so it fits at least as large a micro-batch
    assert fits["full", 0]["batch_size"] >= fits["selective", 0]["batch_size"] >= 1
    assert r["suggested"]["activation_checkpointing"] == "selective"
    assert "--activation_checkpointing=selective" in proc.stdout


@pytest.mark.e2e
def test_the_7b_recipe_cannot_train_under_ddp_and_fits_8_gpus_sharded():
    proc = run_plan("configs/swax/swax_7b_stochastic.py", "--parallelism=ddp", "--gpu_mem_gb=80", "--world_size=8")
    assert proc.returncode == 0, proc.stderr
    assert "does NOT fit" in proc.stdout and "--parallelism=fsdp" in proc.stdout
    r = plan(PlanOptions(gpu_mem_gb=80, world_size=8), ["configs/swax/swax_7b_stochastic.py", "--parallelism=ddp"])
    assert r["n_params"] > 6.8e9 and 16 * r["n_params"] > 80e9  # weights, gradients, AdamW alone
    assert r["static_exceeds_budget"] and all(fit["batch_size"] is None for fit in r["fits"])
    # as shipped: FSDP over 8 GPUs holds 1/8 of the 16 B/param, plus the units gathered at the moment
    r = plan(PlanOptions(gpu_mem_gb=80, world_size=8), ["configs/swax/swax_7b_stochastic.py"])
    static = r["configured"]["static_gib"]
    assert r["parallelism"] == "fsdp" and r["configured_fits"] and not r["static_exceeds_budget"]
    assert static["weights, gradients, AdamW state (fp32, sharded)"] == pytest.approx(16 * r["n_params"] / 8 / GIB)
    assert sum(static.values()) < 20
    # more GPUs, less memory each
    r16 = plan(PlanOptions(gpu_mem_gb=80, world_size=16), ["configs/swax/swax_7b_stochastic.py"])
    assert r16["configured"]["total_gib"] < r["configured"]["total_gib"]


# every paper-scale recipe: the GPUs its comment assumes and its global batch in tokens (the paper's)
RECIPES = {
    **{f"configs/bridges/owt_124m_{v}.py": (8, 131_072) for v in ("full", "block", "swa", "bridge", "pbb", "se_bridge")},
    **{f"configs/sa/slimpajama_360m_{v}.py": (4, 3_932_160) for v in ("full", "swa", "sa", "sa_swa")},
    "configs/swat/fineweb_swat_340m.py": (8, 524_288),
    **{f"configs/swax/swax_1p4b_{v}.py": (8, 1_048_576) for v in ("stochastic", "swa_w128", "swa_w2048", "transformer",
                                                               "w128", "w256", "w512", "w1024", "w2048", "xlstm")},
    **{f"configs/swax/swax_gdn_1p4b_{v}.py": (8, 1_048_576) for v in ("stochastic", "w128", "w2048")},
    **{f"configs/mswa/mswa_wt103_{v}.py": (1, 16_384) for v in ("swa", "mswa", "mswa_h", "mswa_l", "w64", "w256", "w512",
                                                             "reverse", "arithmetic")},
    **{f"configs/mswa/mswa_enwik8_{v}.py": (1, 49_152) for v in ("swa", "mswa", "mswa_h", "mswa_l")},
    **{f"configs/mswa/mswa_linear_{v}.py": (1, 16_384) for v in ("transformer", "linear", "linear_swa", "linear_mswa",
                                                              "mswa")},
    **{f"configs/swax/swax_7b_{v}.py": (8, 1_048_576) for v in ("stochastic", "w128", "w2048")},  # sharded
}


def test_paper_recipes_fit_80gb_gpus_with_headroom_and_keep_their_global_batch():
    for config, (gpus, tokens) in RECIPES.items():
        r = plan(PlanOptions(gpu_mem_gb=80, world_size=gpus, headroom=0.10), [config])
        assert r["global_tokens"] == tokens, config
        assert r["configured_fits"], f"{config}: {r['configured']['total_gib']:.1f} GiB > {r['budget_gib']:.1f}"
        assert r["gradient_accumulation_steps"] % gpus == 0, config
    assert plan(PlanOptions(world_size=1), ["configs/mswa/mswa_wt103_swa.py"])["vocab_assumed"]  # vocab_size=0: 50304


@pytest.mark.parametrize("args", [["configs/bridges/owt_124m_full.py", "--world_size=0"],
                                  ["configs/bridges/owt_124m_full.py", "--kernels=tpu"],
                                  ["configs/bridges/owt_124m_full.py", "--batch_sise=4"],
                                  ["--world_size=8"]])
@pytest.mark.e2e
def test_bad_options_exit_with_status_2(args):
    proc = run_plan(*args)
    assert proc.returncode == 2 and "config error" in proc.stderr, proc.stderr
