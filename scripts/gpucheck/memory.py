"""The memory step: the measured peak memory of the 1.4B SWAX recipe's blocks against the planner's, in a child
process."""

import json
from pathlib import Path

import torch

from attention.registry import pattern_names
from config import load_config
from model import GPT
from runtime import memory_plan
from common.outputs import write_json
from scripts.gpucheck.context import StepContext, outcome
from scripts.gpucheck.options import FULL, MEMORY_HEADROOM, MEMORY_RATIO, REDUCED, CheckConfig


def step_memory(ctx: StepContext) -> dict:
    """One forward and backward of the 1.4B SWAX recipe's blocks at 16K tokens (one sequence, bf16, eager, no
    activation checkpointing), its peak memory against runtime/memory_plan.py's estimate for the same shapes:
    building the model and one step, about 30 s. On CPU only the estimate (nothing measures the peak)."""
    path = ctx.out / "memory.json"
    path.unlink(missing_ok=True)
    done = ctx.run([ctx.python, "-m", "scripts.gpu_check", "--worker=memory", f"--device={ctx.device}",
                    f"--quick={ctx.cfg.quick}", f"--out={ctx.out}"], "memory")
    if done.timed_out or done.returncode != 0 or not path.exists():
        return outcome("failed", "the memory measurement failed", None, done.error())
    r = json.loads(path.read_text())
    shape = f"{r['n_layer']} layers x {r['n_embd']}, {r['tokens']:,} tokens"
    if r.get("out_of_memory"):
        low, high = MEMORY_RATIO
        bound = r["more_than_gib"] / r["estimated_gib"]
        return outcome("failed", f"{shape}: out of memory above {r['more_than_gib']:.1f} GiB, planned "
                       f"{r['estimated_gib']:.2f} GiB: measured / planned > {bound:.2f}",
                       r, f"the model was sized so that a peak of {MEMORY_HEADROOM:.2f} x the plan fits: "
                       f"runtime/memory_plan.py's estimate is off by more than its stated accuracy ({low}-{high} x the "
                       "measured peak): its per-layer saved-activation counts need fixing")
    if r["measured_gib"] is None:
        return outcome("passed", f"{shape}: planned {r['estimated_gib']:.2f} GiB (not measured on CPU)", r)
    summary = (f"{shape}: measured / planned = {r['measured_gib']:.2f} / {r['estimated_gib']:.2f} GiB = "
               f"{r['ratio']:.2f}")
    low, high = MEMORY_RATIO
    if not low <= r["ratio"] <= high:
        return outcome("failed", summary, r, f"runtime/memory_plan.py's estimate is off by more than its stated "
                       f"accuracy ({low}-{high} x the measured peak): its per-layer saved-activation counts need fixing")
    return outcome("passed", summary, r)


def memory_worker(cfg: CheckConfig, device: str) -> None:
    """The memory step's measurement: OUT/memory.json."""
    size = (FULL if device == "cuda" and not cfg.quick else REDUCED)["memory"]
    overrides = [f"--{key}={value}" for key, value in size.items() if key not in ("config", "n_layer") and value]
    run_cfg = load_config([size["config"], *overrides, "--batch_size=1", "--activation_checkpointing=none",
                           "--loss_chunk=0", "--dropout=0.0"])
    m = run_cfg.model
    m.vocab_size = m.vocab_size or memory_plan.DEFAULT_VOCAB
    kernels = memory_plan.Kernels(device, 2 if device == "cuda" else memory_plan.F32)

    def planned(n_layer: int):
        m.n_layer = n_layer
        with torch.device("meta"):
            model = GPT(m)
        e = memory_plan.estimate(model, kernels, 1, "none", 0, memory_plan.Layout(1, "ddp"))
        # no optimizer step and no DDP: the parameters and their gradients are there before it starts (below)
        autocast = e.static.get("autocast bf16 weight copies", 0)
        return e, e.activations_peak + autocast

    n_layer = size["n_layer"] or m.n_layer
    if device == "cuda":  # as many of the recipe's layers as fit this GPU with headroom, whole pattern periods
        period = len(pattern_names(m.attn_pattern))  # swax: 2 layers

        def needed(layers: int) -> float:  # the float32 weights and gradients, and the planned peak with headroom
            step = planned(layers)[1]
            return 2 * memory_plan.F32 * _param_count(m) + MEMORY_HEADROOM * step
        n_layer = memory_layers(n_layer, period, 0.9 * torch.cuda.mem_get_info()[0], needed)
    estimate, estimated = planned(n_layer)
    result = {"config": size["config"], "n_layer": n_layer, "recipe_n_layer": load_config([size["config"]]).model.n_layer,
              "n_embd": m.n_embd, "attn_pattern": m.attn_pattern, "tokens": m.block_size, "batch_size": 1,
              "dtype": "bfloat16" if device == "cuda" else "float32", "estimated_gib": estimated / 2**30,
              "estimate_breakdown_gib": {"activations at the peak": estimate.activations_peak / 2**30,
                                         "autocast weight copies": (estimated - estimate.activations_peak) / 2**30},
              "peak_moment": estimate.peak_moment, "measured_gib": None, "ratio": None}
    if device == "cuda":
        torch.manual_seed(0)
        with torch.device(device):  # built on the GPU: initialising 1.4B parameters on the CPU takes minutes
            model = GPT(m)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        x = torch.randint(0, m.vocab_size, (1, m.block_size), device=device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base, free = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(x, x)
            loss.backward()
            torch.cuda.synchronize()
        except torch.cuda.OutOfMemoryError:  # the peak passed MEMORY_HEADROOM x the plan: a ratio beyond bounds
            # the step needed more than was free when it started (and at least the peak it reached)
            result.update(out_of_memory=True, measured_gib=None, ratio=None, weights_and_gradients_gib=base / 2**30,
                          more_than_gib=max(free, torch.cuda.max_memory_allocated() - base) / 2**30)
            write_json(result, Path(cfg.out) / "memory.json")
            return
        measured = torch.cuda.max_memory_allocated() - base
        result.update(measured_gib=measured / 2**30, ratio=measured / estimated,
                      weights_and_gradients_gib=base / 2**30)
    write_json(result, Path(cfg.out) / "memory.json")


def memory_layers(n_layer: int, period: int, free: float, needed) -> int:
    """The most layers, from n_layer down by whole pattern periods (at least one period), whose needed(layers)
    bytes fit in free."""
    while n_layer > period and needed(n_layer) > free:
        n_layer -= period
    return n_layer


def _param_count(m) -> int:
    with torch.device("meta"):
        return GPT(m).num_params()
