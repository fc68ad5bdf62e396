"""The backends step: every backend of every rule family against the dense reference, in a child process."""

import json
import math
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from attention import simulate_cuda
from attention.edges import Causal
from attention.kernels import plans_in, span_available
from attention.layer import Attention
from attention.ops.span.spans import spans_problem
from attention.registry import build_mixer, example_cases, pattern_names
from config import ModelConfig
from common.outputs import write_json
from scripts.gpucheck.context import StepContext, outcome
from scripts.gpucheck.options import (BACKEND_CONTEXT, BACKEND_HEADS, BACKEND_WINDOW, FULL, REDUCED, TOLERANCE,
                                      CheckConfig)
from scripts.gpucheck.processes import tail


def step_backends(ctx: StepContext) -> dict:
    """Every backend of every rule family (the registry's cases under edge rules) against dense. On an H100 each
    (rule, padded length, dtype) compiles its FlexAttention kernels once, forward and backward (~5 s each): two
    per family (float32 at 300, bfloat16 at 1024), split over ctx.jobs worker processes: about a minute and a
    half."""
    shards = ctx.jobs if ctx.device == "cuda" else 1
    paths = [ctx.out / f"backends_{i}.json" for i in range(shards)]
    for path in paths:
        path.unlink(missing_ok=True)
    command = [ctx.python, "-m", "scripts.gpu_check", "--worker=backends", f"--device={ctx.device}",
               f"--quick={ctx.cfg.quick}", f"--out={ctx.out}"]
    with ThreadPoolExecutor(max_workers=shards) as pool:
        done = list(pool.map(lambda i: ctx.run(command + [f"--shard={i}/{shards}"], f"backends_{i}"), range(shards)))
    parts = [json.loads(path.read_text()) for path in paths if path.exists()]
    results = {"device": ctx.device, "tolerance": TOLERANCE, "window": BACKEND_WINDOW,
               "expected_cases": sum(part["expected_cases"] for part in parts),
               "cases": [case for part in parts for case in part["cases"]], "workers": shards}
    cases = results["cases"]
    failed = [c for c in cases if not c["passed"]]
    expected = results["expected_cases"] if len(parts) == shards else 0
    summary = f"{len(cases) - len(failed)}/{expected or len(cases)} cases within tolerance"
    if failed:
        summary += "; failed: " + ", ".join(sorted({f"{c['family']}/{c['backend']}/{c['dtype']}" for c in failed}))
    broken = [d for d in done if d.timed_out or d.returncode != 0]
    if broken:
        return outcome("failed", summary + f" ({len(cases)} of {expected or '?'} cases ran)", results,
                       "\n\n".join(d.error() for d in broken))
    if failed or not cases or len(cases) < expected:
        return outcome("failed", summary, results, "\n".join(f"{c['family']} {c['backend']} {c['dtype']} n={c['n']}: "
                                                            f"{c.get('error') or 'outside tolerance'}" for c in failed))
    return outcome("passed", summary, results)


def backend_families() -> dict[str, dict]:
    """The cases of the registry (example_cases) whose layers are attention that plans its kernels by backend
    (attention under edge rules, and sa's permuted window: Mixer.plan), each with its settings: the backends
    step compares every backend of each with the dense reference."""
    families = {}
    for name, settings in example_cases(BACKEND_WINDOW).items():
        mixers = family_mixers(settings, "dense")
        if len({type(m) for m in mixers}) == 1 and all(isinstance(m, Attention) for m in mixers) \
                and all(plans_in(m.plan(1, 64, "cpu")) for m in mixers):  # MoBA chooses in its own kernels
            families[name] = settings
    return families


def family_mixers(settings: dict, backend: str, head_dim: int = 16, device="meta") -> list:
    """The layers of a case's model with attn_backend=backend, in evaluation mode, sa with its deterministic
    permutation (the same one under every backend)."""
    layers = len(pattern_names(settings["attn_pattern"]))
    config = ModelConfig(**{"arch": "llama", "n_layer": layers, "n_head": BACKEND_HEADS, "n_embd": BACKEND_HEADS * head_dim,
                            "block_size": BACKEND_CONTEXT, "bias": False, **settings, "attn_backend": backend,
                            "sa_mode": "deterministic"})
    with torch.device(device):
        return [build_mixer(config, i).eval() for i in range(config.n_layer)]


def backend_cases(device: str, sizes: dict) -> list[tuple]:
    """(family, backend, dtype, n) of every comparison: float32 at its first length, then bfloat16, then the
    other float32 lengths (the broadest coverage first, in case the budget runs out)."""
    plan = [("float32", n) for n in sizes["float32"][:1]] + [("bfloat16", n) for n in sizes["bfloat16"]] \
        + [("float32", n) for n in sizes["float32"][1:]]
    families = backend_families()
    cases = []
    for dtype, n in plan:
        for family, settings in families.items():
            layer = family_mixers(settings, "dense")[-1]
            causal = hasattr(layer, "edge_rule") and type(layer.edge_rule()) is Causal
            # plain causal attention: sdpa is its fast path; every other rule runs block-sparse, and on the GPU
            # path span attention where every path's rows are runs of keys (its Triton kernels)
            backends = ("sdpa", "flex") if causal else ("flex", "chunked")
            if not causal and simulate_cuda.gpu_path(device) and span_available() and hasattr(layer, "paths") \
                    and not any(spans_problem(rule) for rule in layer.paths()):
                backends += ("span",)
            for backend in backends:
                # CPU flex runs forward only (torch 2.13 has no CPU backward for it), eagerly (~1 s a call): a
                # check of its masks, in float32; its numerics matter on the GPU (the CPU standing in for CUDA
                # runs its reference forward and backward, compiled with aot_eager, in both dtypes)
                if backend == "flex" and not simulate_cuda.gpu_path(device) and dtype != "float32":
                    continue
                cases.append((family, backend, dtype, n))
    return cases


def family_attention(family: str, head_dim: int, device: str):
    """attention(q, k, v, backend) of a case's deepest layer, its own kernel (kernel_forward) under each backend;
    backend "dense" is the reference."""
    settings = backend_families()[family]
    layers = {}

    def attention(q, k, v, backend):
        if backend not in layers:
            layers[backend] = family_mixers(settings, backend, head_dim, device)[-1]
        return layers[backend].kernel_forward(q, k, v)
    return attention


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: str) -> tuple[float, float, bool]:
    """(max abs error, relative error ||err|| / ||ref||, within TOLERANCE[dtype])."""
    err = (out.float() - ref).abs()
    max_abs = err.max().item() if err.numel() else 0.0
    rel = (err.norm() / ref.norm().clamp(min=1e-30)).item()
    if dtype == "float32":
        ok = bool((err <= 2e-5 + 1e-4 * ref.abs()).all())
    else:
        ok = rel <= 2e-2
    return max_abs, rel, ok and math.isfinite(max_abs)


def run_backend_case(family, backend, dtype_name, n, head_dim, device) -> dict:
    heads = BACKEND_HEADS
    attention = family_attention(family, head_dim, device)
    generator = torch.Generator().manual_seed(1000 + n)
    q, k, v, grad_out = (torch.randn(2, heads, n, head_dim, generator=generator).to(device) for _ in range(4))
    # the reference: dense in float32 from the same values
    ref_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attention(*ref_inputs, "dense")
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad_out)
    dtype = getattr(torch, dtype_name)
    with_grad = not (backend == "flex" and not simulate_cuda.gpu_path(device))  # CPU flex: forward only
    inputs = [t.to(dtype).requires_grad_(with_grad) for t in (q, k, v)]
    out = attention(*inputs, backend)
    result = {"family": family, "backend": backend, "dtype": dtype_name, "n": n, "heads": heads,
              "head_dim": head_dim}
    result["fwd_max_abs"], result["fwd_rel"], fwd_ok = compare(out, ref, dtype_name)
    bwd_ok = True
    if with_grad:
        grads = torch.autograd.grad(out, inputs, grad_out.to(dtype))
        compared = [compare(g, r, dtype_name) for g, r in zip(grads, ref_grads)]
        result["bwd_max_abs"] = max(c[0] for c in compared)
        result["bwd_rel"] = max(c[1] for c in compared)
        bwd_ok = all(c[2] for c in compared)
    else:
        result["bwd_max_abs"] = result["bwd_rel"] = None
    result["passed"] = fwd_ok and bwd_ok
    return result


def backends_worker(cfg: CheckConfig, device: str) -> None:
    """The backends step's comparisons, in this process (a child of the check), writing OUT/backends_SHARD.json after
    every case so that a crash or a timeout keeps the cases done."""
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")  # CPU flex
    sizes = (FULL if device == "cuda" and not cfg.quick else REDUCED)["backends"]
    shard, shards = (int(x) for x in cfg.shard.split("/"))
    cases = backend_cases(device, sizes)[shard::shards]
    path = Path(cfg.out) / f"backends_{shard}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {"device": device, "tolerance": TOLERANCE, "window": BACKEND_WINDOW, "expected_cases": len(cases),
              "cases": []}
    for family, backend, dtype, n in cases:
        started = time.time()
        try:
            result = run_backend_case(family, backend, dtype, n, sizes["head_dim"], device)
        except Exception as e:  # one backend failing is a result: record it and go on
            result = {"family": family, "backend": backend, "dtype": dtype, "n": n, "passed": False,
                      "error": tail(f"{type(e).__name__}: {e}", 1500), "traceback": tail(traceback.format_exc())}
        result["seconds"] = round(time.time() - started, 2)
        report["cases"].append(result)
        write_json(report, path)
        errors = "  ".join(f"{key} {result[f'{key}_max_abs']:.2e}" for key in ("fwd", "bwd")
                           if result.get(f"{key}_max_abs") is not None)
        print(f"{family:<18}{backend:<9}{dtype:<10}n={n:<6}{errors:<26}{result['seconds']:>6.2f} s  "
              f"{'ok' if result['passed'] else 'FAIL'}" + (f"  {result['error']}" if "error" in result else ""),
              flush=True)
