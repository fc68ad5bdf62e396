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

import contextlib
import importlib
import io
import multiprocessing
import os
from pathlib import Path
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

if not __package__:  # run as a file, the project's modules cannot be imported: say how to run it
    sys.exit("run it from the repository root as a module: python -m scripts.hopper_compile ...")

from attention.edges import FixedBlock, SlidingWindow  # noqa: E402
from attention.moba import MOBA_BLOCK, MOBA_TOPK  # noqa: E402
from attention.ops.moba import op as moba_op  # noqa: E402
from attention.ops.span import op as span_op  # noqa: E402
from attention.ops.span.spans import band_spans, static_spans  # noqa: E402
from attention.stochastic import PermutedWindow  # noqa: E402
from config import ConfigError, apply_args, dataclass_fields, exit_on_config_error  # noqa: E402
from common.outputs import (atomic_write, claim_own_folder, markdown_table, own_folder_problem,  # noqa: E402
                             write_json)

# Triton is imported inside the functions that use it: --help and ptxas_problem must work where it is absent

CAPABILITY = 90  # Hopper: Triton targets sm_90a there (wgmma, TMA)
# (sigmoid, ALiBi slopes, a second order of the rows, packed documents) per configuration of span attention, and the
# variants that launch it: the constexprs that change a span kernel's code
SPAN_CONFIGURATIONS = {
    "span softmax": (False, False, False, False),  # swa, mswa, blocks, the bridges; MoBA's own blocks
    "span softmax, ALiBi": (False, True, False, False),  # swat_softmax
    # sa: the band over permuted rows (read in slots), causal in the tokens' order
    "span softmax, order": (False, False, True, False),
    "span sigmoid": (True, False, False, False),  # swat with swat_slopes=none
    "span sigmoid, ALiBi": (True, True, False, False),  # swat
    # document_mask: spans cut to the documents, and a backward that stops at them; sa compares documents instead
    "span softmax, docs": (False, False, False, True),
    "span sigmoid, ALiBi, docs": (True, True, False, True),
    "span softmax, order, docs": (False, False, True, True),
}
PAIR_CONFIGURATION = "span softmax, two paths summed"  # bridge, pbb, se_bridge (branch fusion): Kernel.run_sum
APART_CONFIGURATION = "span softmax, two paths apart"  # sa_swa: sa in slots, then swa adding into its gradients
MOBA_CONFIGURATIONS = {"moba": False, "moba docs": True}  # packed documents or not
WINDOW = 256  # the span configurations' windows: a window reaches the kernels only as lo and hi tensors


@dataclass
class HopperConfig:
    batch: int = 4
    heads: int = 16
    kv_heads: int = 0  # key/value heads (grouped-query attention); 0: as many as heads
    length: int = 32768
    head_dim: int = 64
    dtype: str = "bfloat16"  # the inputs' dtype: bfloat16 as training runs (autocast), or float32
    moba_block: int = MOBA_BLOCK.default
    moba_topk: int = MOBA_TOPK.default
    jobs: int = 0  # kernels compiled at once, one process each; 0: one per core
    json: str = ""
    sass: str = ""  # a folder to write each kernel's SASS into (nvdisasm), numbered as the rows


SASS_MARKER = ".hopper_compile"  # marks a --sass folder as this tool's own


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


# ---- stand-in CUDA tensors -------------------------------------------------------------------------------------

CUDA = torch.device("cuda", 0)


class CudaStandIn(torch.Tensor):
    """A meta tensor that says it is on CUDA: code that branches on a tensor's device takes its CUDA branch, and
    nothing is allocated."""

    @property
    def device(self):
        return CUDA

    @property
    def is_cuda(self):
        return True


def _names_cuda(x) -> bool:
    """Whether an argument names a CUDA device: torch.device("cuda", 0), "cuda:0"."""
    return (isinstance(x, torch.device) and x.type == "cuda") or (isinstance(x, str) and x.startswith("cuda"))


class CudaAsMeta(TorchFunctionMode):
    """CUDA made of stand-ins: a tensor asked for on CUDA is made on the meta device, and every meta result is a
    stand-in. Torch itself sees plain meta tensors (its meta functions read a tensor's device to build their
    outputs); code on real CPU tensors (the ops' planning on the host) runs as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        def to_meta(x):
            if isinstance(x, CudaStandIn):
                return x.as_subclass(torch.Tensor)
            return torch.device("meta") if _names_cuda(x) else x

        args, kwargs = tree_map(to_meta, (args, kwargs or {}))
        out = func(*args, **kwargs)
        return tree_map(lambda t: t.as_subclass(CudaStandIn) if type(t) is torch.Tensor and t.is_meta else t, out)


# ---- the launches the ops make ---------------------------------------------------------------------------------

@dataclass
class Launch:
    """One kernel launch as an op's Python code makes it: tensors as plain meta tensors of the same shape, strides
    and dtype."""

    configuration: str
    kernel: object  # a triton JITFunction
    args: tuple
    kwargs: dict


def kernel_modules() -> list:
    """The modules that define the Triton kernels, as the ops import them (attention/ops/*/op.py: triton_kernels)."""
    return [span_op.triton_kernels(), moba_op.triton_kernels()]


def kernels_of(module) -> dict:
    """The kernels a module defines and Python launches: its Triton functions named *_kernel (the others, such as
    tile_dot, are called from kernels only)."""
    from triton.runtime.jit import JITFunction

    return {name: obj for name, obj in vars(module).items() if isinstance(obj, JITFunction)
            and name.endswith("_kernel") and obj.fn.__module__ == module.__name__}


class _Recorder:
    """Stands in for a kernel: kernel[grid](*args, **kwargs) records the launch instead of running it."""

    def __init__(self, kernel, launches: list, configuration: list):
        self.kernel, self.launches, self.configuration = kernel, launches, configuration

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(Launch(self.configuration[0], self.kernel, tuple(map(_plain, args)),
                                        {k: _plain(v) for k, v in kwargs.items()}))
        return launch


def _plain(x):
    """A stand-in as the plain meta tensor it is: Triton reads its dtype and its address (0: aligned, as CUDA's
    allocations are)."""
    return x.as_subclass(torch.Tensor) if isinstance(x, CudaStandIn) else x


@contextlib.contextmanager
def recording(launches: list, configuration: list):
    """Every Triton function of the kernel modules replaced by a recorder (the launched ones record; the others,
    called only from kernels, are never reached from Python), put back on exit: a kernel's code reads the
    functions it calls from its module's globals when it is compiled."""
    from triton.runtime.jit import JITFunction

    replaced = []
    for module in kernel_modules():
        for name, obj in list(vars(module).items()):
            if isinstance(obj, JITFunction):
                replaced.append((module, name, obj))
                setattr(module, name, _Recorder(obj, launches, configuration))
            elif type(obj).__name__ == "InterpretedFunction":
                raise RuntimeError(f"{module.__name__}.{name} was defined for Triton's interpreter (TRITON_INTERPRET=1 "
                                   "as the kernels were imported): compile in a process without it, "
                                   "python -m scripts.hopper_compile")
    try:
        yield
    finally:
        for module, name, obj in replaced:
            setattr(module, name, obj)


def record_launches(c: HopperConfig) -> list[Launch]:
    """The launches of every configuration's forward and backward, on stand-in CUDA tensors. MoBA's forward caches
    its plan (static_spans) under the device "cuda:0", holding stand-ins: call it in a process of its own, as
    main does."""
    B, H, n, D = c.batch, c.heads, c.length, c.head_dim
    H_kv, dtype = c.kv_heads or c.heads, getattr(torch, c.dtype)
    launches, configuration = [], [""]
    with recording(launches, configuration), CudaAsMeta():
        # laid out as the layers pass them: heads-first views of (B, n, H, D) projections
        q = torch.empty(B, n, H, D, dtype=dtype, device=CUDA).transpose(1, 2)
        k, v = (torch.empty(B, n, H_kv, D, dtype=dtype, device=CUDA).transpose(1, 2) for _ in range(2))
        for name, (sigmoid, alibi, ordered, documents) in SPAN_CONFIGURATIONS.items():
            configuration[0] = name
            halo = -1
            if ordered:  # sa in slots, as its layer runs it: the layout's rows read at their tokens
                rule = PermutedWindow(torch.randperm(n), WINDOW)
                halo = rule.halo
                spans = band_spans(rule, n + 2 * halo, CUDA)
            else:
                spans = static_spans(SlidingWindow(WINDOW), n, 1, 0, "cpu").to(CUDA)
            slopes = torch.empty(H, dtype=torch.float32, device=CUDA) if alibi else None  # float32 in any model
            docs = torch.empty(B, n, dtype=torch.long, device=CUDA) if documents else None
            lo, hi, docs, doc_end = span_op.document_spans(spans, docs)
            out, lse = span_op.triton_forward(q, k, v, lo, hi, spans.order, slopes, 0.0, sigmoid, docs, halo)
            span_op.triton_backward(torch.empty_like(out), q, k, v, out, lse, lo, hi, spans.key_first,
                                    spans.key_end, spans.order, slopes, 0.0, sigmoid, docs=docs, doc_end=doc_end,
                                    halo=halo)
        # the bridges' branch fusion: two paths summed, the second pass adding the first's output and gradients
        configuration[0] = PAIR_CONFIGURATION
        a, b = (static_spans(rule, n, 1, 0, "cpu").to(CUDA) for rule in (FixedBlock(WINDOW), SlidingWindow(WINDOW)))
        out, out_a, lse_a, lse_b = span_op.triton_pair_forward(q, k, v, a.lo, a.hi, b.lo, b.hi, None, None)
        span_op.triton_pair_backward(torch.empty_like(out), None, q, k, v, out, out_a, lse_a, lse_b, a.lo, a.hi,
                                     a.key_first, a.key_end, None, None, b.lo, b.hi, b.key_first, b.key_end, None,
                                     None)
        # sa_swa's two paths apart: sa in slots, then swa, whose backward adds its gradients into sa's
        configuration[0] = APART_CONFIGURATION
        rule = PermutedWindow(torch.randperm(n), WINDOW)
        sa = band_spans(rule, n + 2 * rule.halo, CUDA)
        out, out_a, lse_a, lse_b = span_op.triton_pair_forward(q, k, v, sa.lo, sa.hi, b.lo, b.hi, None, None, sa.order,
                                                               rule.halo, summed=False)
        span_op.triton_pair_backward(torch.empty_like(out), torch.empty_like(out_a), q, k, v, out, out_a, lse_a,
                                     lse_b, sa.lo, sa.hi, sa.key_first, sa.key_end, sa.order, None, b.lo, b.hi,
                                     b.key_first, b.key_end, None, None, rule.halo, summed=False)
        k, v = (torch.empty(B, n, H, D, dtype=dtype, device=CUDA).transpose(1, 2) for _ in range(2))
        for name, documents in MOBA_CONFIGURATIONS.items():
            configuration[0] = name
            docs = torch.empty(B, n, dtype=torch.long, device=CUDA) if documents else None
            chosen = moba_op.triton_choose(q, k, c.moba_block, c.moba_topk, docs)
            own = moba_op.own_blocks(c.moba_block, n, "cpu").to(CUDA)
            out, lse = moba_op.triton_forward(q, k, v, chosen, own, c.moba_block, docs)
            moba_op.triton_backward(torch.empty_like(out), q, k, v, out, lse, chosen, own, c.moba_block, docs)
    launched = {launch.kernel.fn.__name__ for launch in launches}
    never = [name for module in kernel_modules() for name in kernels_of(module) if name not in launched]
    if never:
        raise RuntimeError(f"kernels no configuration launches: {', '.join(never)} (add their op to "
                           "scripts/hopper_compile.py: record_launches)")
    return launches


# ---- what Triton compiles for each launch -----------------------------------------------------------------------

def compilation_task(launch: Launch, backend) -> dict:
    """What Triton's launch code (JITFunction.run) would compile for the launch on this target: the signature
    (argument types), the constexprs (and the integers equal to 1), the attributes (16-byte alignment,
    divisibility by 16) and the options (num_warps, num_stages), as plain data a worker process can take."""
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, specialization, options)
    named = {fn.arg_names[path[0]]: value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)
             for path, value in constexprs.items() if len(path) == 1}
    return {"module": fn.fn.__module__, "kernel": fn.fn.__name__, "signature": signature, "constexprs": constexprs,
            "attrs": attrs, "options": dict(options.__dict__), "named_constexprs": named}


def compilation_tasks(launches: list[Launch]) -> list[dict]:
    """One task per distinct compilation, with the configurations that launch it (in order of first launch)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", CAPABILITY, 32))
    tasks = {}
    for launch in launches:
        task = compilation_task(launch, backend)
        key = repr({k: v for k, v in task.items() if k != "named_constexprs"})
        tasks.setdefault(key, {**task, "launched_by": []})
        if launch.configuration not in tasks[key]["launched_by"]:
            tasks[key]["launched_by"].append(launch.configuration)
    return list(tasks.values())


# ---- compiling and reading the machine code ----------------------------------------------------------------------

INSTRUCTION = re.compile(r"/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BRANCH_TARGET = re.compile(r"\bBRA\b.*?`\((\.L_x_\d+)\)")
MMA = ("HMMA", "HGMMA")
ATOMICS = ("RED", "REDG", "REDS", "ATOM", "ATOMG", "ATOMS")


def opcode(instruction: str) -> str:
    """The operation of a SASS instruction without its predicate and modifiers: MUFU of @!P0 MUFU.EX2 R1, R2."""
    words = instruction.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def innermost_loops(sass: str) -> list[list[str]]:
    """The instructions of each innermost loop of a kernel's SASS (nvdisasm's, with labels), from its label to its
    backward branch, in the code's order: a loop is a label and the last branch back to it, and one whose span
    holds another loop is not innermost. A kernel may walk its blocks in several loops one after another (a
    window's edges and its interior): each is a loop of its own. The branch-to-itself after EXIT is no loop."""
    instructions, labels = [], {}
    for line in sass.splitlines():
        if label := LABEL.match(line):
            labels[label.group(1)] = len(instructions)
        elif match := INSTRUCTION.search(line):
            instructions.append(match.group(2))
    ends = {}
    for i, instruction in enumerate(instructions):
        target = BRANCH_TARGET.search(instruction)
        if target and target.group(1) in labels and labels[target.group(1)] < i:
            ends[labels[target.group(1)]] = i
    loops = sorted(ends.items())
    return [instructions[s:e + 1] for s, e in loops
            if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in loops)]


COPY_WAIT = re.compile(r"\bDEPBAR\.LE SB0, (0x[0-9a-f]+|\d+)")


def copies_in_flight(loop: list[str]) -> int | None:
    """The cp.async groups a loop's tightest wait (DEPBAR.LE SB0, n) lets stay in flight, None without a wait: 0
    means each iteration waits for every copy it has issued, so the rows it prefetches arrive no earlier than
    loads in the iteration would (Triton's pipeliner leaves such a loop when a copy's address comes from a load
    in the same iteration)."""
    waits = [int(m.group(1), 0) for m in map(COPY_WAIT.search, loop) if m]
    return min(waits) if waits else None


def loop_counts(loop: list[str]) -> dict:
    ops = [opcode(instruction) for instruction in loop]
    return {"instructions": len(ops), "mufu": ops.count("MUFU"), "mma": sum(op in MMA for op in ops),
            "atomics": sum(op in ATOMICS for op in ops), "copies_in_flight": copies_in_flight(loop)}


def ptxas_report(ptx: str, options) -> dict:
    """Registers and spilled bytes from ptxas -v, run on the kernel's PTX as Triton runs it (its flags): Triton
    keeps the cubin, not ptxas' report."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", CAPABILITY, 32))
    log = io.StringIO()
    with triton.knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        triton.knobs.nvidia.dump_ptxas_log = True  # Triton prints ptxas' report (always made: it passes -v)
        backend.make_cubin(ptx, {}, options, CAPABILITY)
    text = log.getvalue()
    registers = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if not registers or not spills:
        raise RuntimeError(f"no register or spill count in ptxas' report:\n{text}")
    return {"registers": int(registers.group(1)), "spill_stores": int(spills.group(1)),
            "spill_loads": int(spills.group(2))}


def disassemble(cubin: bytes) -> str:
    import triton

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([triton.knobs.nvidia.nvdisasm.path, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout


def compile_task(task: dict) -> dict:
    """Compile one task for sm_90a and read its machine code: a result row (with "error" where it fails)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    row = {"kernel": task["kernel"], "launched_by": task["launched_by"], "constexprs": task["named_constexprs"],
           "num_warps": task["options"]["num_warps"], "num_stages": task["options"]["num_stages"]}
    started = time.time()
    try:
        fn = getattr(importlib.import_module(task["module"]), task["kernel"])
        source = ASTSource(fn, task["signature"], task["constexprs"], task["attrs"])
        compiled = triton.compile(source, target=GPUTarget("cuda", CAPABILITY, 32), options=task["options"])
        options = make_backend(GPUTarget("cuda", CAPABILITY, 32)).parse_options(task["options"])
        row.update(ptxas_report(compiled.asm["ptx"], options))
        row["shared"] = compiled.metadata.shared
        row["sass"] = disassemble(compiled.asm["cubin"])
    except Exception as e:  # a kernel that does not compile is a result: the others still report
        row["error"] = error_text(e)
        row["seconds"] = round(time.time() - started, 1)
        return row
    row["loops"] = [loop_counts(loop) for loop in innermost_loops(row["sass"])]
    row["mufu_per_score"] = [mufu_per_score(loop, row) for loop in row["loops"]]
    row["seconds"] = round(time.time() - started, 1)
    return row


def error_text(e: BaseException) -> str:
    """The error and its causes, the root cause first (Triton's CompilationError shows where, its cause why)."""
    chain = [e]
    while chain[-1].__cause__ is not None and len(chain) < 8:
        chain.append(chain[-1].__cause__)
    return "\n".join(f"{type(x).__name__}: {x}"[-3000:] for x in reversed(chain))


def mufu_per_score(loop: dict, row: dict) -> float | None:
    """A loop's MUFU count over the scores a thread computes per iteration: a tile of BLOCK_M rows by BLOCK_N keys
    (BLOCK_C blocks for MoBA's choice) over 32 x num_warps threads; None for a kernel without such a tile."""
    constexprs = row["constexprs"]
    rows, cols = constexprs.get("BLOCK_M"), constexprs.get("BLOCK_N", constexprs.get("BLOCK_C"))
    if not isinstance(rows, int) or not isinstance(cols, int):
        return None
    return loop["mufu"] / (rows * cols / (32 * row["num_warps"]))


def ptxas_problem() -> str:
    """Why nothing can be compiled for Hopper here ("" when Triton and its bundled ptxas are installed)."""
    try:
        import triton
    except ImportError:
        return "Triton is not installed"
    try:
        triton.knobs.nvidia.ptxas.path
        triton.knobs.nvidia.nvdisasm.path
    except RuntimeError as e:
        return f"Triton's NVIDIA tools are absent ({e})"
    return ""


def compile_kernels(c: HopperConfig) -> list[dict]:
    """Every kernel configuration compiled for sm_90a: one row each, in the order the ops first launch them."""
    tasks = compilation_tasks(record_launches(c))
    jobs = min(len(tasks), c.jobs or os.cpu_count() or 1)
    # fork: the workers find the kernels as this process defined them (not for the interpreter) and import nothing
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(compile_task, tasks))


# ---- the report --------------------------------------------------------------------------------------------------

def row_name(row: dict) -> str:
    """The kernel and the first configuration that launches it, as a file name."""
    return f"{row['kernel']}@{row['launched_by'][0]}".replace(", ", "+").replace(" ", "_")


def table(rows: list[dict]) -> str:
    header = ["kernel", "launched by", "registers", "spills (B, st/ld)", "shared (B)", "loop instructions", "MUFU",
              "HGMMA/HMMA", "atomics", "copies in flight", "MUFU per score"]
    lines = []
    for row in rows:
        name = [row["kernel"], "; ".join(row["launched_by"])]
        if "error" in row:
            lines.append(name + ["error: " + row["error"].splitlines()[0][:120]] + [""] * (len(header) - 3))
            continue
        # a kernel with several innermost loops: one value each, in the code's order
        per_loop = [" / ".join("-" if loop[key] is None else str(loop[key]) for loop in row["loops"]) or "-"
                    for key in ("instructions", "mufu", "mma", "atomics", "copies_in_flight")]
        per_score = " / ".join("-" if x is None else f"{x:.2f}" for x in row["mufu_per_score"]) or "-"
        lines.append(name + [row["registers"], f"{row['spill_stores']}/{row['spill_loads']}", row["shared"],
                             *per_loop, per_score])
    return markdown_table(header, lines, right=set(range(2, len(header))), aligned=True)


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
