"""The GPU benchmark in one call: what each variant's attention costs per allowed edge, what the model trains at,
and train.py's step against nanoGPT's.

    python -m scripts.gpu_bench --nanogpt=../nanoGPT/model.py          # the three tables (about 6 minutes, H200)
    python -m scripts.gpu_bench --parts=kernels --lengths=8192 --kernel_variants=full,swa,swat
    python -m scripts.gpu_bench --parts=train --train_variants=full,swa,swax --train_len=16384
    python -m scripts.gpu_bench --parts=train --train_variants=full,swa --train_cuda_graphs=True
    python -m scripts.gpu_bench --parts=train --train_variants=full,swa,full:cuda_graphs=True,swa:cuda_graphs=True

Parts:
  kernels   forward + backward of each variant's attention op (bench_attention's cases: the layer's own plan and
            kernel, CASE:KEY=VALUE for settings such as swa:attn_backend=flex) at each length, --batch x --heads x
            --head_dim in bf16 with --window: best time of the repeats, against full attention (SDPA's flash
            kernel), scores computed per allowed edge, and time per allowed edge relative to swa's
  train     a GPT-2 124M (configs/bridges/owt_124m_full.py) at --train_len tokens, batch 1, each variant's windows and
            blocks --train_window long (MoBA: blocks of half of it, top 2), compiled bf16 with train.py's layout
            (runtime/parallelize.py), with --train_cuda_graphs as CUDA graphs (train.py's --cuda_graphs), and
            VARIANT:KEY=VALUE for train.py's settings of one case (the defaults include full and swa with
            cuda_graphs=True): median step time and tokens/s of the timed steps against full attention with the
            same settings, MFU, and the host's time to enqueue a
            step; the --train_profile cases then profile 3 steps (the kernels that took their time, and the GPU's
            busy time per step: a host time near the step's and a busy time well below it is a step bound by the
            host's kernel launches)
  nanogpt   GPT-2 124M, batch 16 x 1024, bf16 autocast, fused AdamW, steps alternating between train.py's layout, the
            same model compiled whole and nanoGPT's model.py compiled whole (--nanogpt: its file, from a clone of
            github.com/karpathy/nanoGPT; without it this part is left out and says so)

Every case runs in a process of its own (one torch thread), in rounds of --jobs cases: a round's cases compile and
warm up at once (inductor's and Triton's caches are shared on disk); once all are warm, each times alone, one after
the other (a file lock), from its warm state, so no case is timed beside another's work (a case not warm by
--ready_by is stopped and reported), and only a round's cases hold GPU memory at once (a round takes fewer than
--jobs cases where their planned memory would pass 80% of the GPU's: six training cases at 8K on an 80 GiB H100).
Each case's log (OUT/logs) says where its warm-up spent its time. Results: the tables printed and written to OUT/report.md, every number in
OUT/gpu_bench.json with the GPU's name and the torch and Triton versions.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

if not __package__:  # run as a file, the project's modules cannot be imported: say how to run it
    sys.exit("run it from the repository root as a module: python -m scripts.gpu_bench ...")

from config import ConfigError, apply_args, dataclass_fields, exit_on_config_error  # noqa: E402
from common.outputs import atomic_write, claim_own_folder, own_folder_problem, write_json  # noqa: E402
from scripts.gpubench.cases import CASES  # noqa: E402
from scripts.gpubench.options import OUTPUT_MARKER, PARTS, BenchConfig  # noqa: E402
from scripts.gpubench.report import collect, report  # noqa: E402
from scripts.gpubench.rounds import run_jobs  # noqa: E402
from scripts.gpubench.timing import safe  # noqa: E402


def parse(argv) -> BenchConfig:
    b = BenchConfig()
    apply_args(b, argv, dataclass_fields(BenchConfig))
    unknown = [p for p in b.parts.split(",") if p not in PARTS]
    if unknown:
        raise ConfigError(f"parts: unknown {', '.join(unknown)}; expected some of {', '.join(PARTS)}")
    if not b.job and own_folder_problem(Path(b.out), OUTPUT_MARKER, "the GPU benchmark", "out/gpu_bench"):
        raise ConfigError(own_folder_problem(Path(b.out), OUTPUT_MARKER, "the GPU benchmark", "out/gpu_bench"))
    if b.nanogpt and not Path(b.nanogpt).is_file():
        raise ConfigError(f"nanogpt={b.nanogpt}: no such file; give the path of nanoGPT's model.py (a clone of "
                          "github.com/karpathy/nanoGPT)")
    if min(b.repeats, b.train_steps, b.nanogpt_steps, b.batch) < 1:
        raise ConfigError("repeats, train_steps, nanogpt_steps and batch must be >= 1")
    return b


def main(argv):
    b = exit_on_config_error(parse, argv)
    out = Path(b.out)
    if b.job:
        part, _, job = b.job.partition(":")
        name, _, tiles = job.partition("@")  # VARIANT@MxNxWARPSxSTAGES: tiles set by the driver (rounds.run_round)
        results = CASES[part](name, b, out)
        if tiles:
            for row in results:
                row["variant"] = job
        write_json(results, out / "results" / f"{part}_{safe(job)}.json")
        return
    if b.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: the GPU benchmark needs CUDA (torch " + torch.__version__ + " sees no GPU): run it on a GPU "
                 "machine; python -m scripts.bench_attention and scripts.bench_train measure on the CPU")
    claim_own_folder(out, OUTPUT_MARKER)
    for sub in ("logs", "results", "ready"):  # its own files from an earlier run (the folder is its own)
        (out / sub).mkdir(parents=True, exist_ok=True)
        for old in (out / sub).iterdir():
            old.unlink()
    import triton

    where = torch.cuda.get_device_name() if b.device == "cuda" else "CPU (a check of the script, not a measurement)"
    header = (f"{where}, torch {torch.__version__}, Triton {triton.__version__}; "
              f"kernels: B={b.batch} H={b.heads} d={b.head_dim} bf16, window {b.window}")
    print(header, flush=True)
    started = time.time()

    def write(results: dict, partial: str = "") -> tuple[str, dict]:
        rows = collect(results)
        text = report(b, argv, header + partial, time.time() - started, rows)
        atomic_write(out / "report.md", lambda f: f.write((text + "\n").encode()))
        write_json({"header": header + partial, "config": asdict(b), **rows}, out / "gpu_bench.json")
        return text, rows

    # after each round, the report so far: a run stopped from outside (a machine's time running out) keeps what
    # its finished rounds measured, labelled as partial
    text, rows = write(run_jobs(b, argv, out, after_round=lambda results, done, rounds: write(
        results, f" (partial: {done} of {rounds} rounds done, the rest still running or stopped)")))
    print(text)
    sys.exit(1 if rows["errors"] else 0)


if __name__ == "__main__":
    main(sys.argv[1:])
