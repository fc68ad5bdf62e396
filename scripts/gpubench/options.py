"""What the GPU benchmark runs: its options, its parts, and the cases they name (by default every attention case
of the registry)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from attention.layer import Attention
from attention.registry import MIXERS, PATTERN_ALIASES, example_cases, pattern_names

PARTS = ("kernels", "train", "nanogpt")
# the kernels FlexAttention also runs, beside the default cases: the baselines span attention is measured against
FLEX_BASELINES = ("swa:attn_backend=flex", "swat:attn_backend=flex")
OUTPUT_MARKER = ".gpu_bench"  # marks OUT as the benchmark's own: each run empties its logs and results there


@dataclass
class BenchConfig:
    parts: str = "kernels,train,nanogpt"
    out: str = "out/gpu_bench"
    # kernels
    # cases of the registry (example_cases), CASE:KEY=VALUE for settings, VARIANT@MxNxWxS for span attention's tiles
    # of M query rows x N keys, W warps, S stages; "": every attention case of the registry and FLEX_BASELINES
    kernel_variants: str = ""
    lengths: str = "8192,32768"
    batch: int = 4
    heads: int = 16
    head_dim: int = 64
    window: int = 256
    repeats: int = 10
    # train
    # mixers or pattern aliases, VARIANT:KEY=VALUE for train.py settings (swa:cuda_graphs=True); "": every attention
    # mixer of the registry and every alias, and GRAPH_CASES
    train_variants: str = ""
    train_len: int = 8192
    train_window: int = 512
    train_steps: int = 10
    # training cases whose timed steps are followed by 3 profiled ones: the GPU kernels that took their time
    train_profile: str = "full,swa"
    train_compile: bool = True  # False: eager (a quick check of the script on the CPU)
    # the training cases with CUDA graphs (train.py's --cuda_graphs: blocks and ends compiled with
    # mode="reduce-overhead", each step marked): whether a step bound by the host's kernel launches gets faster
    train_cuda_graphs: bool = False
    # nanogpt
    nanogpt: str = ""  # nanoGPT's model.py
    nanogpt_steps: int = 20
    nanogpt_batch: int = 16
    train_layers: int = 0  # 0: the config's 12 (fewer: a quick check of the script)
    timeout: int = 480  # seconds for the whole benchmark; cases unfinished by then are reported as such
    ready_by: int = 150  # seconds for a round's cases to compile and warm up; later ones are stopped and reported
    jobs: int = max(1, min(8, (os.cpu_count() or 2) // 2))  # cases per round: warming up (compiling) at once
    device: str = "cuda"  # cpu: runs the script's code on small sizes (a check of the script, not a measurement)
    job: str = ""  # internal: run one case (PART:NAME) in this process


# the cost of packed documents (docs/documents.md): the same kernels with document_mask, documents of 200-3000 tokens
DOCUMENT_CASES = ("full:document_mask=True", "swa:document_mask=True")
# training as train.py --cuda_graphs=True runs it: a step bound by the host's launches replayed (docs/training.md)
GRAPH_CASES = ("full:cuda_graphs=True", "swa:cuda_graphs=True")


def default_variants() -> tuple[list[str], list[str]]:
    """(kernel cases, training variants) from the registry: every case whose layer is attention (its kernel is
    what the kernels table times) with FlexAttention's baselines, and every attention mixer and pattern alias."""
    attention = lambda names: all(issubclass(MIXERS[n], Attention) for n in names)  # noqa: E731
    kernels = [name for name, settings in example_cases(256).items()
               if len(pattern_names(settings["attn_pattern"])) == 1 and attention(pattern_names(settings["attn_pattern"]))]
    train = [name for name, cls in MIXERS.items() if issubclass(cls, Attention)] + list(PATTERN_ALIASES)
    return kernels + list(FLEX_BASELINES) + list(DOCUMENT_CASES), train + list(GRAPH_CASES)


def jobs(b: BenchConfig) -> list[tuple[str, str]]:
    """The cases to run, (part, name) each: the variants the options name, else the defaults."""
    parts = b.parts.split(",")
    kernels, train = default_variants()
    out = []
    if "kernels" in parts:
        out += [("kernels", v) for v in (b.kernel_variants.split(",") if b.kernel_variants else kernels)]
    if "train" in parts:
        out += [("train", v) for v in (b.train_variants.split(",") if b.train_variants else train)]
    if "nanogpt" in parts and b.nanogpt:
        out.append(("nanogpt", "gpt2_124m"))
    return out
