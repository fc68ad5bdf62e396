"""Training throughput (tokens/s, and MFU on GPUs) of model configs, on synthetic tokens.

    python -m scripts.bench_train                                   # CPU: 124M gpt2 and 360M llama at 2 layers
    python -m scripts.bench_train --device=cuda --n_layer=0 --compile=True   # GPU: full depth
    python -m scripts.bench_train --configs=configs/bridges/owt_124m_full.py --batch_size=4 --json=out/bench.json
    python -m scripts.bench_train --n_layer=0 --compile=True --batch_size=16 --activation_checkpointing=selective \
        --loss_chunk=4096

Each step is a forward, backward and AdamW update at the config's block_size; the first warmup steps are
not timed (they include compilation). n_layer=0 keeps each config's own depth. The model is laid out as
train.py lays it out (runtime/parallelize.py): activation checkpointing per block, then each block compiled on its
own; loss_chunk computes the LM head and the loss that many tokens at a time, as train.py's option does.
"""

import os
import sys
import time
from dataclasses import dataclass

import torch

if not __package__:  # run as a file, the project's modules cannot be imported: say how to run it
    sys.exit("run it from the repository root as a module: python -m scripts.bench_train ...")

from config import ConfigError, apply_args, dataclass_fields, exit_on_config_error, load_config  # noqa: E402
from model import GPT  # noqa: E402
from common.flops import peak_flops  # noqa: E402
from common.machine import busy_note  # noqa: E402
from common.outputs import write_json  # noqa: E402
from runtime.parallelize import ACTIVATION_CHECKPOINTING, parallelize  # noqa: E402


@dataclass
class BenchConfig:
    configs: str = "configs/bridges/owt_124m_full.py,configs/sa/slimpajama_360m_full.py"
    n_layer: int = 2  # 0: each config's own depth
    batch_size: int = 1
    block_size: int = 0  # 0: each config's own
    steps: int = 5
    warmup: int = 2
    device: str = "auto"
    dtype: str = "auto"  # auto: bfloat16 on GPUs, float32 on CPU
    compile: bool = False  # torch.compile each block, as train.py does
    activation_checkpointing: str = "none"  # none | full | selective (train.py's option)
    loss_chunk: int = 0  # tokens per chunk of the LM head + loss (train.py's option); 0: all at once
    json: str = ""  # also write the results here


def parse(argv) -> BenchConfig:
    b = BenchConfig()
    apply_args(b, argv, dataclass_fields(BenchConfig))
    if b.steps < 1 or b.warmup < 0 or b.batch_size < 1:
        raise ConfigError("need steps >= 1, warmup >= 0 and batch_size >= 1")
    if b.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
        raise ConfigError(f"activation_checkpointing={b.activation_checkpointing!r}: expected one of "
                          f"{', '.join(ACTIVATION_CHECKPOINTING)}")
    if b.loss_chunk < 0:
        raise ConfigError(f"loss_chunk={b.loss_chunk}: must be >= 0")
    return b


def bench(config_file: str, b: BenchConfig, device: torch.device, dtype: torch.dtype) -> dict:
    overrides = [f"--n_layer={b.n_layer}"] if b.n_layer else []
    overrides += [f"--block_size={b.block_size}"] if b.block_size else []
    # the bench's own choices replace the recipe's (configs set compile=True for training)
    overrides += [f"--compile={b.compile}", f"--activation_checkpointing={b.activation_checkpointing}",
                  f"--loss_chunk={b.loss_chunk}", "--parallelism=ddp"]
    cfg = load_config([config_file, *overrides, "--dropout=0.0"])
    m = cfg.model
    m.vocab_size = m.vocab_size or 50304
    torch.manual_seed(0)
    model = GPT(m).to(device)
    optimizer = model.configure_optimizer(0.1, 1e-4, (0.9, 0.95), device.type)
    try:  # checkpointing and per-block compilation exactly as train.py applies them (no DDP here)
        step_fn = parallelize(model, cfg.train, device, dtype, distributed=False)
    except ValueError as e:
        raise SystemExit(f"{config_file}: cannot compile: {e}")
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    x = torch.randint(0, m.vocab_size, (b.batch_size, m.block_size + 1), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(b.warmup + b.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with autocast:
            _, loss = step_fn(x[:, :-1], x[:, 1:], loss_chunk=b.loss_chunk)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= b.warmup:
            times.append(time.perf_counter() - t0)
    seconds = sorted(times)[len(times) // 2]  # median step
    tokens_per_s = b.batch_size * m.block_size / seconds
    peak = peak_flops(device, dtype)
    result = {"config": config_file, "arch": m.arch, "n_layer": m.n_layer, "n_embd": m.n_embd,
              "params_M": round(model.num_params() / 1e6, 2), "block_size": m.block_size, "batch_size": b.batch_size,
              "compile": b.compile, "activation_checkpointing": b.activation_checkpointing,
              "loss_chunk": b.loss_chunk, "step_ms": round(1000 * seconds, 1), "tokens_per_s": round(tokens_per_s, 1)}
    if peak:
        result["mfu"] = round(model.flops_per_token(m.block_size) * tokens_per_s / peak, 4)
    if device.type == "cuda":  # the most this process's tensors held during the steps
        result["max_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return result


def main(argv):
    b = exit_on_config_error(parse, argv)
    device = torch.device(b.device if b.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype_name = b.dtype if b.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    if device.type == "cuda":  # as train.py: TF32 for any float32 matmul left outside autocast
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    if busy_note(torch.get_num_threads()):
        print(busy_note(torch.get_num_threads()))
    print(f"device: {where}; dtype {dtype_name}; torch {torch.__version__}")
    results = [bench(f, b, device, dtype) for f in b.configs.split(",")]
    columns = list(results[0])
    print(" | ".join(columns))
    for r in results:
        print(" | ".join(str(r.get(c, "")) for c in columns))
    if b.json:
        os.makedirs(os.path.dirname(b.json) or ".", exist_ok=True)
        write_json({"device": where, "dtype": dtype_name, "torch": str(torch.__version__), "results": results}, b.json)


if __name__ == "__main__":
    main(sys.argv[1:])
