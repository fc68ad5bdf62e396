"""The benchmark's cases, each run in a process of its own (python -m scripts.gpu_bench --job=PART:NAME): a variant's
attention kernel forward + backward at each length, a GPT-2 124M training step with a variant's layers, and
train.py's step against nanoGPT's. Each warms up, then times in its turn (timing.TurnToTime) and returns its rows."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch

from attention.capabilities import EdgeCounts
from attention.kernels import layer_scores
from attention.registry import build_mixer, pattern_names, pattern_settings
from common.flops import peak_flops
from config import ConfigError, load_config
from model import GPT
from runtime.parallelize import parallelize
from scripts.bench_attention import BenchConfig as AttentionConfig
from scripts.bench_attention import backend_of, variant_config
from scripts.gpucheck.environment import wrong_triton_for_hopper
from scripts.gpucheck.options import gpu_kernel_mixers
from scripts.gpubench.options import BenchConfig
from scripts.gpubench.timing import TurnToTime, max_memory_gib, profile_steps, progress, release_memory, synchronize


def kernel_case(name: str, b: BenchConfig, out: Path) -> list[dict]:
    device = torch.device(b.device)
    a = AttentionConfig(batch=b.batch, heads=b.heads, head_dim=b.head_dim, window=b.window, dtype="bfloat16")
    steps = []
    for n in (int(x) for x in b.lengths.split(",")):
        m = variant_config(name, a, n)
        with torch.device(device):
            mixer = build_mixer(m, m.n_layer - 1).to(device)  # the deepest layer (MSWA's widest windows)
        step = kernel_step(mixer, mixer.kernel_inputs(b.batch, n, device, torch.bfloat16))
        for _ in range(2):  # compilation, autotuning, caches
            step()
        progress(f"{name} warm at n={n}")
        edges = sum(e for _, e in mixer.edge_counts(n)) / m.n_head if isinstance(mixer, EdgeCounts) else None
        scores = layer_scores(mixer, n, device)[1]
        steps.append((n, m, mixer, step, edges, scores))
    results = []
    release_memory()
    with TurnToTime(out):
        for n, m, mixer, step, edges, scores in steps:
            step()  # untimed: the allocator's blocks again
            times = []
            for _ in range(b.repeats):
                t0 = time.perf_counter()
                step()
                synchronize()
                times.append(1000 * (time.perf_counter() - t0))
            results.append({"variant": name, "n": n, "backend": backend_of(mixer, n, device), "ms": min(times),
                            "runs_ms": [round(t, 3) for t in times], "edges_per_head": edges,
                            "scores_per_head": scores, "scores_per_edge": scores / edges if scores and edges else None})
    return results


def kernel_step(mixer, inputs):
    """One forward + backward of the mixer's kernel on these inputs (each length's own: no shared closure)."""
    grad = None

    def step():
        nonlocal grad
        y = mixer.kernel_forward(*inputs)
        grad = torch.randn_like(y) if grad is None else grad
        y.backward(grad)
        for t in inputs:
            t.grad = None
    return step


def train_settings(variant: str, b: BenchConfig) -> list[str]:
    """train.py's settings for the variant's run: its windows and blocks at train_window, those its mixers read."""
    w = b.train_window
    sizes = {"swa_window": w, "block_len": w, "bridge_width": w, "bridge_extension": w // 2, "moba_block": w // 2,
             "moba_topk": 2}
    read = pattern_settings(variant)
    return [f"--attn_pattern={variant}", f"--block_size={b.train_len}",
            *(f"--{key}={value}" for key, value in sizes.items() if key in read)]


def fla_refusal(pattern: str, device: torch.device) -> str:
    """Why a pattern with a mixer on fla's kernels cannot train here ("" where it can): fla refuses its gated
    backward on a Hopper GPU under Triton 3.4.0 to 3.7.0 (fla issue #640), after its kernels have compiled."""
    if device.type != "cuda":
        return ""
    import triton

    fla = {name for name, kernel in gpu_kernel_mixers().items() if kernel[1] == "fla"}
    mixers = set(pattern_names(pattern)) & fla
    if not mixers or not wrong_triton_for_hopper(torch.cuda.get_device_capability(device)[0], triton.__version__):
        return ""
    return (f"{', '.join(sorted(mixers))} trains on fla's kernels, which refuse their gated backward on a Hopper GPU "
            f"under Triton {triton.__version__} (3.4.0 to 3.7.0 compile it wrongly: fla issue #640): run it with "
            "Triton 3.7.1 (torch 2.13.0), as requirements.txt pins")


def train_case(name: str, b: BenchConfig, out: Path) -> list[dict]:
    device, dtype = torch.device(b.device), torch.bfloat16
    variant, *settings = name.split(":")  # VARIANT:KEY=VALUE: train.py settings of this case
    graphs = b.train_cuda_graphs or "cuda_graphs=True" in settings
    if graphs and not b.train_compile:
        raise ConfigError("cuda_graphs replays compiled steps as CUDA graphs: add --train_compile=True")
    layers = [f"--n_layer={b.train_layers}"] if b.train_layers else []
    cfg = load_config(["configs/bridges/owt_124m_full.py", *train_settings(variant, b), *layers,
                       f"--compile={b.train_compile}", f"--cuda_graphs={graphs}", "--activation_checkpointing=none",
                       "--parallelism=ddp", "--dropout=0.0", *(f"--{setting}" for setting in settings)])
    graphs = cfg.train.cuda_graphs
    problem = fla_refusal(cfg.model.attn_pattern, device)
    if problem:  # said at once, not after a minute of compiling that ends in fla's own refusal
        raise RuntimeError(problem)
    torch.manual_seed(0)
    model = GPT(cfg.model).to(device)
    optimizer = model.configure_optimizer(0.1, 1e-4, (0.9, 0.95), device.type)
    step_fn = parallelize(model, cfg.train, device, dtype, distributed=False)
    x = torch.randint(0, cfg.model.vocab_size, (1, cfg.model.block_size + 1), device=device)

    def step():
        if graphs:  # a new step of the CUDA graph trees, as train.py marks it
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device.type, dtype=dtype):
            _, loss = step_fn(x[:, :-1], x[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    progress(f"{name} built")
    for _ in range(3):
        step()
        progress(f"{name} warm-up step")
    times, host = [], []  # each step's wall time, and the host's time to enqueue it (until zero_grad returns)
    release_memory()
    with TurnToTime(out):
        step()  # untimed: the allocator's blocks again
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        for _ in range(b.train_steps):
            t0 = time.perf_counter()
            step()
            host.append(time.perf_counter() - t0)
            synchronize()
            times.append(time.perf_counter() - t0)
        profile, busy = profile_steps(step, 3) if name in b.train_profile.split(",") else ([], None)
    seconds = sorted(times)[len(times) // 2]
    tokens_per_s = cfg.model.block_size / seconds
    peak = peak_flops(device, dtype)
    return [{"variant": name, "tokens": cfg.model.block_size, "step_ms": 1000 * seconds,
             "host_ms": 1000 * sorted(host)[len(host) // 2], "gpu_busy_ms": busy, "tokens_per_s": tokens_per_s,
             "mfu": model.flops_per_token(cfg.model.block_size) * tokens_per_s / peak if peak else 0.0,
             "max_memory_gib": max_memory_gib(graphs), "profile": profile,
             "layers": sorted({type(block.mixer).__name__ for block in model.blocks})}]


def nanogpt_case(name: str, b: BenchConfig, out: Path) -> list[dict]:
    """train.py's layout, our model compiled whole and nanoGPT's compiled whole, on the same batches, alternating."""
    device, dtype = torch.device(b.device), torch.bfloat16
    spec = importlib.util.spec_from_file_location("nanogpt_model", b.nanogpt)
    nano = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nano)
    layers = [f"--n_layer={b.train_layers}"] if b.train_layers else []
    cfg = load_config(["configs/bridges/owt_124m_full.py", *layers, "--compile=True", "--activation_checkpointing=none",
                       "--parallelism=ddp", "--dropout=0.0"])
    m = cfg.model
    models = {}
    torch.manual_seed(0)
    ours = GPT(m).to(device)
    models["train.py's layout"] = (ours, parallelize(ours, cfg.train, device, dtype, distributed=False),
                                   ours.configure_optimizer(0.1, 1e-4, (0.9, 0.95), device.type))
    whole = GPT(m).to(device)
    models["this model compiled whole"] = (whole, torch.compile(whole),
                                           whole.configure_optimizer(0.1, 1e-4, (0.9, 0.95), device.type))
    reference = nano.GPT(nano.GPTConfig(block_size=m.block_size, vocab_size=m.vocab_size, n_layer=m.n_layer,
                                        n_head=m.n_head, n_embd=m.n_embd, dropout=0.0, bias=m.bias)).to(device)
    models["nanoGPT's model.py compiled whole"] = (reference, torch.compile(reference),
                                                   reference.configure_optimizers(0.1, 1e-4, (0.9, 0.95), device.type))
    x = torch.randint(0, m.vocab_size, (b.nanogpt_batch, m.block_size + 1), device=device)
    inputs, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()  # as nanoGPT's get_batch makes them

    def step(forward, optimizer):
        with torch.autocast(device.type, dtype=dtype):
            _, loss = forward(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for label, (_, forward, optimizer) in models.items():
        for _ in range(3):
            step(forward, optimizer)
        progress(f"{label} warm")
    times = {label: [] for label in models}
    release_memory()
    with TurnToTime(out):
        for _, forward, optimizer in models.values():
            step(forward, optimizer)  # untimed: the allocator's blocks again
        for _ in range(b.nanogpt_steps):
            for label, (_, forward, optimizer) in models.items():
                synchronize()
                t0 = time.perf_counter()
                step(forward, optimizer)
                synchronize()
                times[label].append(time.perf_counter() - t0)
    tokens = b.nanogpt_batch * m.block_size
    results = []
    for label, seconds in times.items():
        median = sorted(seconds)[len(seconds) // 2]
        results.append({"model": label, "step_ms": 1000 * median, "tokens_per_s": tokens / median,
                        "params_M": sum(p.numel() for p in models[label][0].parameters()) / 1e6})
    return results


CASES = {"kernels": kernel_case, "train": train_case, "nanogpt": nanogpt_case}
