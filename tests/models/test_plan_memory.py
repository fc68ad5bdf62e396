"""scripts/plan_memory.py: the numbers its command line prints and the paper recipes' fit on 80 GB GPUs (its
activation estimate against the tensors autograd keeps, for every case of the registry, is the conformance kit's:
tests/models/test_conformance.py)."""

import json
import subprocess
import sys

import pytest

from conftest import REPO
from runtime.memory_plan import GIB, PlanOptions, plan

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
