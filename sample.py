"""Sample text from a trained run.

    python sample.py --out_dir=out/quickstart --start="Once upon a time" --num_samples=3 --max_new_tokens=200
    python sample.py --out_dir=out/quickstart --start=FILE:prompt.txt --temperature=0.8 --top_p=0.9
    python sample.py --out_dir=out/swax_small_stochastic --window=16     # a test-time window (paper 003)
"""

import sys
from dataclasses import dataclass

from common import machine  # first: OpenMP's wait policy is read once, when torch loads it

machine.passive_openmp()

import torch  # noqa: E402

from attention import simulate_cuda
from config import ConfigError, apply_args, dataclass_fields, exit_on_config_error, resolve_device
from data.tokenizer import TokenizerUnavailable
from runtime.checkpoint import CheckpointError, describe_checkpoint, load_model, run_tokenizer


@dataclass
class SampleConfig:
    out_dir: str = "out/quickstart"
    ckpt: str = "best"  # best | last
    start: str = "\n"  # the prompt, or FILE:path to read it from a file
    num_samples: int = 3
    max_new_tokens: int = 200
    temperature: float = 0.8  # 0: greedy
    top_k: int = 200  # 0 disables
    top_p: float = 1.0  # nucleus sampling; 1.0 disables
    seed: int = 1337
    device: str = "auto"
    dtype: str = "auto"  # auto: bfloat16 on capable GPUs, float32 otherwise
    use_cache: bool = True  # KV / recurrent caches: one step per new token instead of re-running the context
    window: int = 0  # sliding-window layers use this window instead of the trained one (0: as trained)
    stop_at_eot: bool = False  # print each sample up to its first end-of-text token after the prompt


def parse(argv) -> SampleConfig:
    cfg = SampleConfig()
    apply_args(cfg, argv, dataclass_fields(SampleConfig))
    for key, ok, need in (("temperature", cfg.temperature >= 0, ">= 0"), ("top_p", 0 < cfg.top_p <= 1, "in (0, 1]"),
                          ("top_k", cfg.top_k >= 0, ">= 0"), ("num_samples", cfg.num_samples >= 1, ">= 1"),
                          ("max_new_tokens", cfg.max_new_tokens >= 0, ">= 0"), ("window", cfg.window >= 0, ">= 0"),
                          ("ckpt", cfg.ckpt in ("best", "last"), "best or last")):
        if not ok:
            raise ConfigError(f"{key}={getattr(cfg, key)}: must be {need}")
    if cfg.start.startswith("FILE:"):  # read now: a missing prompt file is a bad option, found before loading
        try:
            with open(cfg.start[5:], encoding="utf-8") as f:
                cfg.start = f.read()
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
            raise ConfigError(f"--start=FILE:{cfg.start[5:]}: cannot read the prompt file ({reason})") from None
    return cfg


def free_memory(device: str) -> int | None:
    """Bytes free for new tensors on the device (CUDA: the driver's count; CPU: MemAvailable), None if unknown."""
    if str(device).startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def generation_memory_problem(model, s: SampleConfig, prompt_len: int, device: str) -> str:
    """Why the generation asked for cannot fit in memory ("" when it can): said before anything is allocated,
    with the most new tokens that do fit."""
    free = free_memory(device)
    need = lambda new: model.generation_bytes(s.num_samples, prompt_len + new, s.use_cache)  # noqa: E731
    if free is None or need(s.max_new_tokens) <= free:
        return ""
    low, high = 0, s.max_new_tokens  # the most new tokens that fit: need() grows with the length
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if need(mid) <= free else (low, mid - 1)
    return (f"--max_new_tokens={s.max_new_tokens:,}: {s.num_samples} samples of {prompt_len + s.max_new_tokens:,} "
            f"tokens would hold {need(s.max_new_tokens) / 2**30:,.1f} GiB (token ids and the layers' caches), more than "
            f"the {free / 2**30:.1f} GiB free on {device}; at most about {low:,} new tokens fit: lower --max_new_tokens "
            "(or --num_samples)")


def main(argv):
    s = exit_on_config_error(parse, argv)
    device = exit_on_config_error(resolve_device, s.device)
    try:
        model, cfg, ckpt = load_model(s.out_dir, s.ckpt, device)
        tokenizer = run_tokenizer(ckpt)
    except (CheckpointError, TokenizerUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    print(describe_checkpoint(ckpt), file=sys.stderr)  # stderr: stdout holds the samples alone
    dtype = s.dtype if s.dtype != "auto" else simulate_cuda.auto_dtype(device)
    model = model.to(getattr(torch, dtype))
    if s.window and model.set_window(s.window) == 0:
        print(f"error: --window={s.window}: the model of {s.out_dir} ({cfg.model.attn_pattern}) has no sliding-window "
              "layers", file=sys.stderr)
        sys.exit(2)

    ids = tokenizer.encode(s.start) or [tokenizer.eot_id]  # parse() has read a FILE: prompt
    block_size = cfg.model.block_size
    if len(ids) + s.max_new_tokens > block_size:  # said, not silently done
        longest = len(ids) + s.max_new_tokens
        if model.wpe is not None:
            print(f"note: prompt and continuation reach {longest} tokens, beyond block_size={block_size}: the model "
                  f"sees only the last {block_size} (learned positions)", file=sys.stderr)
        else:
            print(f"note: prompt and continuation reach {longest} tokens, beyond the training length "
                  f"block_size={block_size}: positions past it were never trained on", file=sys.stderr)
    problem = generation_memory_problem(model, s, len(ids), device)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    x = torch.tensor([ids] * s.num_samples, dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(s.seed)
    y = model.generate(x, s.max_new_tokens, temperature=s.temperature, top_k=s.top_k or None,
                       top_p=s.top_p, generator=generator, use_cache=s.use_cache)
    for row in y.tolist():
        print(sample_text(tokenizer, row, len(ids), s.stop_at_eot))
        print("---------------")


EOT_TEXT = "<|endoftext|>"


def sample_text(tokenizer, ids: list[int], prompt_len: int, stop_at_eot: bool = False) -> str:
    """A sample's text with every end-of-text token shown as <|endoftext|>, whatever the tokenizer (the byte
    tokenizer's decode drops it, and documents would run together); stop_at_eot ends it at the first one after the
    prompt."""
    eot = tokenizer.eot_id
    if stop_at_eot and eot in ids[prompt_len:]:
        ids = ids[:prompt_len + ids[prompt_len:].index(eot)]
    pieces, start = [], 0
    for i, token in enumerate(ids + [eot]):
        if token == eot:
            pieces.append(tokenizer.decode(ids[start:i]))
            start = i + 1
    return EOT_TEXT.join(pieces)


if __name__ == "__main__":
    main(sys.argv[1:])
