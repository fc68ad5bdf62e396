"""Compile a small model per mixer as train.py does and count graph breaks and unexpected recompiles.

    python -m scripts.compile_check                          # every mixer, inductor, on CUDA when available
    python -m scripts.compile_check --mixers=swa,sa,swax --device=cpu
    python -m scripts.compile_check --backend=aot_eager      # Dynamo + AOTAutograd only: no code generation (fast)
    python -m scripts.compile_check --json=out/compile_check.json

Every case of the mixer registry is checked (attention/registry.py: example_cases: each registered mixer with
its example settings, each of its check_variants such as pbb_union, and each pattern alias such as swax). Each
case builds a 2-layer llama model (or the depth the mixer's example settings ask for), compiles every block on
its own (parallelize.compile_blocks), runs 3 training steps (sa draws a new permutation at every one; a model
with sliding windows switches its window between steps, as stochastic window training does) and one
evaluation forward, as train.py does, then reads torch._dynamo's counters:

  graph breaks   every break is a failure, except one a layer expects (expected_graph_breaks in
                 attention/capabilities.py: fla's Gated DeltaNet kernel, which fla keeps out of compiled graphs)
  graphs         compiled graphs against those expected: one per distinct Mixer.compile_key (layers with equal
                 keys share a graph; a window switch is a new key) in training and one per key in evaluation
                 (grad mode and dropout differ); more is an unexpected recompile, a failure

The exit status is 0 only when every case is clean. On CPU the windowed variants run the chunked kernel (the
CPU training path; FlexAttention has no CPU backward), on CUDA FlexAttention: each device checks its own path.
"""

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass

import torch

if not __package__:  # run as a file, the project's modules cannot be imported: say how to run it
    sys.exit("run it from the repository root as a module: python -m scripts.compile_check ...")

from attention.capabilities import expected_graph_breaks  # noqa: E402
from attention.registry import example_cases, has_window_layers  # noqa: E402
from config import ConfigError, ModelConfig, apply_args, dataclass_fields, exit_on_config_error  # noqa: E402
from model import GPT  # noqa: E402
from runtime.parallelize import compile_blocks  # noqa: E402

WINDOW = 32  # the cases' windows and blocks (example_cases)


@dataclass
class CheckConfig:
    mixers: str = ""  # comma-separated cases; default: every case of the registry (example_cases)
    device: str = "auto"  # auto: cuda when available
    backend: str = "inductor"  # torch.compile backend: inductor (as training) | aot_eager (no code generation)
    dtype: str = "auto"  # auto: bfloat16 autocast on CUDA, float32 on CPU (as train.py)
    steps: int = 3
    block_size: int = 256
    json: str = ""


def parse(argv) -> CheckConfig:
    c = CheckConfig()
    apply_args(c, argv, dataclass_fields(CheckConfig))
    known = list(example_cases(WINDOW))
    unknown = [name for name in c.mixers.split(",") if name and name not in known]
    if unknown:
        raise ConfigError(f"unknown mixer(s) {', '.join(unknown)}: expected some of {', '.join(known)}")
    if c.steps < 1 or c.block_size < 64:
        raise ConfigError("need steps >= 1 and block_size >= 64")
    return c


def case_config(name: str, block_size: int) -> tuple[ModelConfig, tuple | None]:
    """The case's model and, for a model with sliding windows, the window of each training step (switched, as
    stochastic window training does)."""
    settings = dict(example_cases(WINDOW)[name])
    cfg = ModelConfig(**{"arch": "llama", "n_layer": 2, "n_head": 4, "n_embd": 64, "bias": False,
                         "block_size": block_size, "vocab_size": 128, **settings})
    windows = (cfg.swa_window, cfg.swa_window // 2, cfg.swa_window) if has_window_layers(cfg) else None
    return cfg, windows


def check(name: str, c: CheckConfig, device: torch.device, dtype: torch.dtype) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg, windows = case_config(name, c.block_size)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    compiled_graphs = []  # one entry per graph Dynamo hands the backend: per new compile or piece after a break
    backend = torch._dynamo.lookup_backend(c.backend)

    def counting_backend(graph_module, example_inputs):
        compiled_graphs.append(graph_module)
        return backend(graph_module, example_inputs)

    compile_blocks(model, device, dtype, backend=counting_backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size + 1), device=device)
    keys, losses, started = set(), [], time.time()
    for step in range(c.steps):
        if windows:
            model.set_window(windows[step % len(windows)])
        keys |= {("train", block.mixer.compile_key()) for block in model.blocks}
        with autocast:
            _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if windows:
        model.set_window(cfg.swa_window)  # evaluation uses the long window, as in train.py
    model.eval()
    keys |= {("eval", block.mixer.compile_key()) for block in model.blocks}
    with torch.no_grad(), autocast:
        model(x[:, :-1], x[:, 1:])
    breaks = dict(counters["graph_break"])
    expected_breaks = "; ".join(sorted({expected_graph_breaks(b.mixer, device, dtype) for b in model.blocks} - {""}))
    graphs = len(compiled_graphs)
    unexpected_graphs = max(0, graphs - len(keys)) if not expected_breaks else 0
    clean = (not breaks or bool(expected_breaks)) and unexpected_graphs == 0 and all(map(_finite, losses))
    return {"mixer": name, "graph_breaks": sum(breaks.values()), "break_reasons": [r[:300] for r in breaks],
            "expected_breaks": expected_breaks, "graphs": graphs, "expected_graphs": len(keys),
            "unexpected_recompiles": unexpected_graphs, "losses": losses, "seconds": round(time.time() - started, 1),
            "status": "ok" if clean else "FAIL"}


def _finite(value: float) -> bool:
    return value == value and abs(value) != float("inf")


def main(argv):
    c = exit_on_config_error(parse, argv)
    device = torch.device(c.device if c.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype_name = c.dtype if c.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    names = [n for n in c.mixers.split(",") if n] or list(example_cases(WINDOW))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"compile check: {where}; backend {c.backend}; {dtype_name}; torch {torch.__version__}", flush=True)
    print(f"{'mixer':<16}{'graphs':>8}{'expected':>10}{'breaks':>8}{'recompiles':>12}{'seconds':>9}  status")
    results = []
    for name in names:
        try:
            result = check(name, c, device, dtype)
        except Exception as e:  # a failure to compile is a result too: report it and go on
            result = {"mixer": name, "status": "ERROR", "error": f"{type(e).__name__}: {e}"[:2000],
                      "traceback": traceback.format_exc()[-4000:]}
        results.append(result)
        if result["status"] == "ERROR":
            print(f"{name:<16}{'':>47}  ERROR {result['error'][:300]}", flush=True)
            continue
        note = f" ({result['expected_breaks']})" if result["expected_breaks"] else ""
        print(f"{name:<16}{result['graphs']:>8}{result['expected_graphs']:>10}{result['graph_breaks']:>8}"
              f"{result['unexpected_recompiles']:>12}{result['seconds']:>9}  {result['status']}{note}", flush=True)
        for reason in result["break_reasons"][:3]:
            print(f"    break: {reason[:200]}")
    failed = [r["mixer"] for r in results if r["status"] != "ok"]
    print(f"{len(results) - len(failed)}/{len(results)} clean" + (f"; failed: {', '.join(failed)}" if failed else ""))
    if c.json:
        os.makedirs(os.path.dirname(c.json) or ".", exist_ok=True)
        with open(c.json, "w") as f:
            json.dump({"device": where, "backend": c.backend, "dtype": dtype_name, "torch": str(torch.__version__),
                       "results": results}, f, indent=2)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main(sys.argv[1:])
