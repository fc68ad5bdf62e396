"""Generation speed and memory at long contexts: tokens/s of cached decoding and the state it keeps.

    python -m scripts.bench_generate                                   # CPU: swax vs full at 1K and 8K context
    python -m scripts.bench_generate --device=cuda --dtype=bfloat16 --n_layer=24 --n_embd=2048 --n_head=16 \
        --contexts=8192,32768 --json=out/bench_generate_gpu.json

Each model (random weights; speed does not depend on them) reads a prompt of `context` tokens once (prefill),
then decodes `new_tokens` tokens one at a time through its layers' caches, as model.generate does: swa layers
keep a rolling window of keys, recurrent layers (mlstm, gated_deltanet) their fixed-size state, full
attention every key. Reported: prefill time, decode tokens/s (best of --repeats), the bytes of the generation
state after decoding, and on CUDA the peak memory allocated during decoding.
"""

import os
import sys
import time
from dataclasses import asdict, dataclass

import torch

if not __package__:  # run as a file, the project's modules cannot be imported: say how to run it
    sys.exit("run it from the repository root as a module: python -m scripts.bench_generate ...")

from attention.cache import state_bytes  # noqa: E402
from config import ConfigError, ModelConfig, apply_args, dataclass_fields, exit_on_config_error  # noqa: E402
from model import GPT  # noqa: E402
from common.machine import busy_note  # noqa: E402
from common.outputs import write_json  # noqa: E402


@dataclass
class GenerateBenchConfig:
    variants: str = "swax,full"  # attn_pattern values
    contexts: str = "1024,8192"
    new_tokens: int = 64
    batch: int = 1
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    window: int = 128  # swa_window
    vocab_size: int = 512
    dtype: str = "float32"
    device: str = "auto"
    repeats: int = 3
    json: str = ""


@torch.no_grad()
def run_case(pattern: str, context: int, b: GenerateBenchConfig, device) -> dict:
    cfg = ModelConfig(arch="llama", n_layer=b.n_layer, n_head=b.n_head, n_embd=b.n_embd, bias=False,
                      block_size=context + b.new_tokens, vocab_size=b.vocab_size, attn_pattern=pattern,
                      swa_window=b.window)
    torch.manual_seed(0)
    model = GPT(cfg).to(device=device, dtype=getattr(torch, b.dtype)).eval()
    prompt = torch.randint(0, b.vocab_size, (b.batch, context), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best_prefill, best_decode, peak = float("inf"), float("inf"), None
    for _ in range(b.repeats):
        caches = model.init_caches(b.batch, context + b.new_tokens)
        t0 = time.perf_counter()
        logits, _ = model(prompt, caches=caches)
        sync()
        t1 = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        token = logits[:, -1:].argmax(-1)
        for t in range(context, context + b.new_tokens):
            logits, _ = model(token, caches=caches, start_pos=t)
            token = logits[:, -1:].argmax(-1)
        sync()
        t2 = time.perf_counter()
        if device.type == "cuda":
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        best_prefill, best_decode = min(best_prefill, t1 - t0), min(best_decode, t2 - t1)
    return {"variant": pattern, "context": context, "prefill_ms": 1000 * best_prefill,
            "decode_tokens_per_s": b.batch * b.new_tokens / best_decode,
            "state_mib": state_bytes(caches) / 2**20, "decode_peak_mib": peak}


def parse(argv) -> GenerateBenchConfig:
    b = GenerateBenchConfig()
    apply_args(b, argv, dataclass_fields(GenerateBenchConfig))
    if b.new_tokens < 1 or b.repeats < 1:
        raise ConfigError("new_tokens and repeats must be >= 1")
    return b


def main(argv):
    b = exit_on_config_error(parse, argv)
    device = torch.device(b.device if b.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    if busy_note(torch.get_num_threads()):
        print(busy_note(torch.get_num_threads()))
    print(f"device: {where}; {b.n_layer} layers x {b.n_head} heads x {b.n_embd}, window {b.window}, "
          f"batch {b.batch}, {b.new_tokens} new tokens, {b.dtype}; torch {torch.__version__}")
    results = []
    for context in (int(x) for x in b.contexts.split(",")):
        for pattern in b.variants.split(","):
            try:
                r = run_case(pattern, context, b, device)
            except ValueError as e:
                raise SystemExit(f"variant {pattern!r}: {e}")
            results.append(r)
            peak = f"  peak {r['decode_peak_mib']:.1f} MiB" if r["decode_peak_mib"] is not None else ""
            print(f"context {context:>6} {pattern:<10} prefill {r['prefill_ms']:>9.1f} ms  decode "
                  f"{r['decode_tokens_per_s']:>8.1f} tok/s  state {r['state_mib']:>8.2f} MiB{peak}", flush=True)
    if b.json:
        os.makedirs(os.path.dirname(b.json) or ".", exist_ok=True)
        write_json({"device": where, "torch": str(torch.__version__), "config": asdict(b), "results": results}, b.json)


if __name__ == "__main__":
    main(sys.argv[1:])
