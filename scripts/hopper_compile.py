"""Every Triton kernel of span attention and MoBA compiled for Hopper (sm_90a) on this machine, no GPU needed, in
the configurations the ops launch them with: registers, spills, shared memory and the instructions of the
innermost loops of each.

    python -m scripts.hopper_compile                                   # the table (markdown)
    python -m scripts.hopper_compile --json=out/hopper_compile.json --sass=out/sass

The launches are the ops' own: the Python code of attention/ops/span/op.py (forward, backward) and
attention/ops/moba/op.py (choice, forward, backward) runs on stand-in CUDA tensors (meta tensors that say they are
on CUDA: shapes, strides and dtypes, no memory), so it takes every branch it takes on a GPU (tiles, flags), with
each kernel replaced by a recorder. Triton's own launch code then turns each recorded launch into what it would
compile (argument types, constexprs, 16-byte alignment and divisibility, num_warps and num_stages), and Triton
compiles it for sm_90a with its bundled ptxas. Span attention runs in eight configurations (softmax; softmax with
ALiBi, swat_softmax; softmax over a second order of the rows, sa; sigmoid; sigmoid with ALiBi, swat; and softmax,
sigmoid with ALiBi and sa over packed documents), its two-path op in two (the bridges' paths summed, sa_swa's apart),
MoBA in its default one with and without documents; a kernel two configurations launch alike is compiled once.

Columns: registers per thread and the bytes ptxas spills to local memory (stores / loads: 0 / 0 is the goal),
the shared memory a launch requests, and per innermost loop of the SASS (a loop that holds no other: the walk
over key or query blocks; "a / b / c" where a kernel walks them in several loops, in the code's order) its
instructions, its special-function operations (MUFU: exp2, reciprocal, tanh...), its tensor-core instructions
(HGMMA on Hopper, HMMA), its atomics (RED, ATOM) and the cp.async copy groups its wait leaves in flight (DEPBAR.LE
SB0, n: 0 means every iteration waits for all the copies it prefetched, so the loads' latency is not hidden behind
the iteration's arithmetic). MUFU per score is a loop's MUFU count over the scores each thread computes per
iteration (BLOCK_M x BLOCK_N, or BLOCK_C for the choice, over 32 x num_warps threads). In a forward at head
dimension 64 one MUFU operation per score takes as long as the score's matrix products (an H100
does 3.9 T special-function operations per second against 989 TFLOP/s of bfloat16 products, FlashAttention-3's
figures): each one past the first per score slows the loop.

The integers of a launch reach the compiler only as their type (32 or 64 bits), whether they are 1 and whether
16 divides them: the defaults' lengths and strides stand for any multiple of 16 below 2^31.
"""

import os
from pathlib import Path
import subprocess
import sys
import time
from dataclasses import asdict

if not __package__:  # run as a file, the project's modules cannot be imported: say how to run it
    sys.exit("run it from the repository root as a module: python -m scripts.hopper_compile ...")

from attention.ops.span import op as span_op  # noqa: E402
from config import ConfigError, apply_args, dataclass_fields, exit_on_config_error  # noqa: E402
from common.outputs import atomic_write, claim_own_folder, own_folder_problem, write_json  # noqa: E402
from scripts.hoppercompile.compilation import CAPABILITY, compile_kernels, ptxas_problem  # noqa: E402
from scripts.hoppercompile.options import SASS_MARKER, HopperConfig  # noqa: E402
from scripts.hoppercompile.report import row_name, table  # noqa: E402


def parse(argv) -> HopperConfig:
    c = HopperConfig()
    apply_args(c, argv, dataclass_fields(HopperConfig))
    if c.dtype not in ("bfloat16", "float32"):
        raise ConfigError(f"dtype={c.dtype!r}: expected bfloat16 or float32")
    kv_heads = c.kv_heads or c.heads
    if min(c.batch, c.heads, c.length, c.head_dim, c.moba_block) < 1 or c.heads % kv_heads or c.moba_topk < 1:
        raise ConfigError("need positive sizes, kv_heads dividing heads and moba_topk >= 1")
    if c.sass and own_folder_problem(Path(c.sass), SASS_MARKER, "hopper_compile", "out/sass"):
        raise ConfigError(own_folder_problem(Path(c.sass), SASS_MARKER, "hopper_compile", "out/sass").replace(
            "--out", "--sass"))
    return c


def main(argv):
    c = exit_on_config_error(parse, argv)
    if span_op.interpreting():
        # Triton defined its own functions for the interpreter when torch imported it (TRITON_INTERPRET is read as
        # each is defined; the test suite sets it for its processes): compile in a process without it
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        sys.exit(subprocess.run([sys.executable, "-m", "scripts.hopper_compile", *argv], env=env).returncode)
    problem = ptxas_problem()
    if problem:
        sys.exit(f"cannot compile for Hopper: {problem}")
    import triton

    started = time.time()
    rows = compile_kernels(c)
    print(f"Triton {triton.__version__}, sm_{CAPABILITY}a; B={c.batch} H={c.heads} H_kv={c.kv_heads or c.heads} "
          f"n={c.length} d_h={c.head_dim} {c.dtype}; moba block {c.moba_block}, top-{c.moba_topk}; "
          f"{len(rows)} kernels compiled in {time.time() - started:.0f}s")
    print(table(rows))
    if c.sass:  # a folder of its own (parse refuses one holding other files), each file written whole
        claim_own_folder(Path(c.sass), SASS_MARKER)
        for i, row in enumerate(rows):
            if "sass" in row:
                path = Path(c.sass) / f"{i:02d}_{row_name(row)}.sass"
                atomic_write(path, lambda f, text=row["sass"]: f.write(text.encode()))
    if c.json:
        write_json({"triton": triton.__version__, "target": f"sm_{CAPABILITY}a", "config": asdict(c),
                    "kernels": [{k: v for k, v in row.items() if k != "sass"} for row in rows]}, c.json)
    failed = [row_name(row) for row in rows if "error" in row]
    if failed:
        for row in rows:
            if "error" in row:
                print(f"\n{row_name(row)}:\n{row['error']}", file=sys.stderr)
        sys.exit(f"{len(failed)} kernels did not compile: {', '.join(failed)}")


if __name__ == "__main__":
    main(sys.argv[1:])
