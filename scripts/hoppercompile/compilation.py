"""Compiling for Hopper (sm_90a) without a GPU: what Triton's launch code would compile for each recorded launch,
compiled with Triton's bundled ptxas in worker processes, its registers, spills, shared memory and SASS read back."""

import contextlib
import importlib
import io
import multiprocessing
import os
import re
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

from scripts.hoppercompile.configurations import record_launches
from scripts.hoppercompile.options import HopperConfig
from scripts.hoppercompile.recording import Launch
from scripts.hoppercompile.sass import innermost_loops, loop_counts, mufu_per_score

# Triton is imported inside the functions that use it: --help and ptxas_problem must work where it is absent

CAPABILITY = 90  # Hopper: Triton targets sm_90a there (wgmma, TMA)


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


def ptxas_counts(log: str) -> dict | None:
    """Registers and spilled bytes from ptxas -v's report (None when the text holds none)."""
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if not registers or not spills:
        return None
    return {"registers": int(registers.group(1)), "spill_stores": int(spills.group(1)),
            "spill_loads": int(spills.group(2))}


def ptxas_report(ptx: str, options) -> dict:
    """Registers and spilled bytes from ptxas -v, run on the kernel's PTX as Triton runs it (its flags): Triton
    keeps the cubin, not ptxas' report, so a kernel taken from Triton's cache has it assembled again."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", CAPABILITY, 32))
    log = io.StringIO()
    with triton.knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        triton.knobs.nvidia.dump_ptxas_log = True  # Triton prints ptxas' report (always made: it passes -v)
        backend.make_cubin(ptx, {}, options, CAPABILITY)
    counts = ptxas_counts(log.getvalue())
    if counts is None:
        raise RuntimeError(f"no register or spill count in ptxas' report:\n{log.getvalue()}")
    return counts


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
        log = io.StringIO()
        with triton.knobs.nvidia.scope(), contextlib.redirect_stdout(log):
            # ptxas' report of the compilation itself (ptxas runs once per kernel); none where Triton's cache
            # had the kernel and ran no ptxas
            triton.knobs.nvidia.dump_ptxas_log = True
            compiled = triton.compile(source, target=GPUTarget("cuda", CAPABILITY, 32), options=task["options"])
        counts = ptxas_counts(log.getvalue())
        if counts is None:
            options = make_backend(GPUTarget("cuda", CAPABILITY, 32)).parse_options(task["options"])
            counts = ptxas_report(compiled.asm["ptx"], options)
        row.update(counts)
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
