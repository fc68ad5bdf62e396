"""The CUDA path on the CPU: one documented switch under which a CPU run executes the code only a GPU reaches.

    EFFICIENT_ATTENTION_SIMULATE_CUDA=1 python train.py configs/quickstart.py --attn_pattern=swax ...
    with simulate_cuda.simulating(): ...        # the same, in-process (build models inside: layers resolve
                                                # their kernels when they are built)

No GPU has to exist for the GPU path to be tested: with the switch on, code on the CPU takes every branch code
on CUDA takes, and where CUDA hardware or a CUDA-only package would run, a CPU stand-in runs in its place,
with the same output contract (shapes, dtypes, contiguity):

    attention backends   attn_backend=auto picks span attention for rules whose rows are runs of keys and
                         FlexAttention for the other static rules with head_dim >= 16, as on CUDA (plain causal
                         attention keeps SDPA), and the chunked kernel takes its CUDA branch (one batched SDPA
                         call over the tiles, not the CPU flash kernel)
    FlexAttention        compiled with aot_eager instead of inductor, eager calls too: AOTAutograd runs torch's
                         reference implementation of FlexAttention forward and backward (CPU inductor has no
                         FlexAttention backward). Torch's one refusal of CPU autograd (flex_attention's
                         _validate_device) is lifted for the CPU; every other check of flex_attention runs
    torch.compile        train.py and parallelize.compile_blocks compile with aot_eager (same reason)
    GPU kernels          the mLSTM's Triton ops run their CPU stand-ins, registered as the ops' CPU kernels
                         (attention/ops/mlstm/op.py), and Gated DeltaNet's fla kernel runs its stand-in
                         (attention/ops/gated_deltanet/fla_kernel.py): the built-in forms, returning what the real
                         kernels return; this project's span attention and MoBA ops (attention/ops) run their naive
                         references (outside this switch, with TRITON_INTERPRET=1, their CPU kernels run the Triton
                         code itself under the interpreter: the kernel tests). EFFICIENT_ATTENTION_SIMULATE_CUDA=triton
                         (simulating(triton=True)), with TRITON_INTERPRET=1: their Triton code instead, interpreted,
                         called as the model calls it on CUDA (slower: small models)
    dtype=auto           bfloat16 in train.py, sample.py and python -m eval; AdamW fused, as on CUDA
    SDPA outputs         laid out as CUDA's fused kernels lay them out ((B, L, H, D) in memory, not contiguous)

What only a GPU shows: speed and memory, the code inductor and Triton generate for CUDA (and their compile
times), the real kernels' numerics, NCCL, and CUDA's own errors (illegal memory access, launch limits).
The test suite runs this path for every case of the mixer registry (tests/models/test_gpu_sim.py, marker gpu_sim).
Code on a CUDA device takes its own path whatever the switch, and on a machine with CUDA layers are built from
the installed GPU kernel packages as without it (stand_ins): there the switch changes nothing.
"""

from __future__ import annotations

import os
from collections import Counter
from contextlib import contextmanager

import torch

ENV = "EFFICIENT_ATTENTION_SIMULATE_CUDA"


def active() -> bool:
    """Whether the switch is on (EFFICIENT_ATTENTION_SIMULATE_CUDA=1, true, yes, on or triton)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on", "triton")


def interpreted_kernels() -> bool:
    """Whether, while simulating, this project's Triton kernels (span attention, MoBA) run their own code under
    Triton's interpreter rather than their naive references (EFFICIENT_ATTENTION_SIMULATE_CUDA=triton)."""
    return os.environ.get(ENV, "").strip().lower() == "triton"


def gpu_path(device) -> bool:
    """Whether code on `device` takes the CUDA branches: on CUDA, and on the CPU while simulating."""
    kind = torch.device(device).type
    return kind == "cuda" or (kind == "cpu" and active())


def simulated(device) -> bool:
    """Whether `device` is the CPU standing in for CUDA (a stand-in runs where a CUDA kernel would)."""
    return torch.device(device).type == "cpu" and active()


def stand_ins() -> bool:
    """Whether a layer being built may count on the GPU kernels' CPU stand-ins where a kernel's package is missing:
    while simulating, on a machine without CUDA. On a CUDA machine the installed packages decide, as without
    the switch, so the switch changes nothing there."""
    return active() and not torch.cuda.is_available()


# calls of each GPU kernel's CPU stand-in in this process, by the kernel's package (the mixer's gpu_kernel[2]): tests
# check that a simulated run ran the stand-ins, not the built-in forms
STAND_IN_CALLS: Counter = Counter()


def ran(package: str) -> None:
    """Count one call of a stand-in (called by the stand-ins)."""
    STAND_IN_CALLS[package] += 1


def auto_dtype(device, older_gpu: str = "float32") -> str:
    """dtype=auto of train.py, sample.py and python -m eval: bfloat16 on a GPU that has it and on the CPU standing
    in for CUDA, older_gpu on a GPU without it (train.py: float16, with its gradient scaler), float32 on the CPU."""
    kind = torch.device(device).type
    if simulated(device):
        return "bfloat16"
    if kind != "cuda":
        return "float32"
    return "bfloat16" if torch.cuda.is_bf16_supported() else older_gpu


def sdpa_output_layout(y: torch.Tensor) -> torch.Tensor:
    """SDPA's output with the memory layout CUDA's fused kernels (flash, memory-efficient, cuDNN) give it:
    (B, L, H, D) in memory, seen as (B, H, L, D), so not contiguous. The CPU's is contiguous; while simulating,
    code reading an SDPA output meets CUDA's layout (a .view() that only the CPU layout allows fails here too)."""
    return y.transpose(1, 2).contiguous().transpose(1, 2) if y.dim() == 4 else y


def compile_backend(device) -> str:
    """The torch.compile backend for blocks on `device`: inductor, or aot_eager on the CPU while simulating."""
    return "aot_eager" if simulated(device) else "inductor"


@contextmanager
def simulating(on: bool = True, triton: bool = False):
    """The switch for the code inside (restored afterwards): for tests and in-process tools. triton: the Triton
    kernels' own code, interpreted, in place of their naive references (interpreted_kernels)."""
    before = os.environ.get(ENV)
    os.environ[ENV] = ("triton" if triton else "1") if on else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


_lifted = False


def allow_flex_cpu_backward() -> None:
    """Let torch's flex_attention take CPU tensors that require grad (called while simulating, before the first
    FlexAttention call). Torch 2.13 refuses them in one validation function (its CPU kernel generation has no
    backward); the FlexAttention op itself, traced by AOTAutograd, has a device-independent reference backward.
    The replacement keeps that function's other checks; CUDA tensors go through the original."""
    global _lifted
    if _lifted:
        return
    import torch.nn.attention.flex_attention as flex_module

    original = getattr(flex_module, "_validate_device", None)
    if original is None:
        raise RuntimeError(f"torch {torch.__version__}: torch.nn.attention.flex_attention has no _validate_device; "
                           f"attention/simulate_cuda.py was written against torch 2.13.0 (requirements.txt)")

    def validate_device(query, key, value):
        if query.device.type == "cpu" and active():
            return  # the CPU stands in for CUDA: FlexAttention's reference backward runs under AOTAutograd
        return original(query, key, value)

    flex_module._validate_device = validate_device
    _lifted = True


@contextmanager
def autograd_in_kernel():
    """Autograd inside a custom op's kernel, for a stand-in whose backward is the autograd of a built-in form.
    The dispatcher runs an op's kernels below autograd (its dispatch keys excluded), where autograd.grad would
    find nothing recorded; this lifts that exclusion for the code inside (functorch's vjp is no way out: it
    fails under opcheck's schema and fake-tensor checks)."""
    from torch._C import DispatchKey

    included = torch._C._dispatch_tls_local_include_set()
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for key in (DispatchKey.AutogradFunctionality, DispatchKey.ADInplaceOrView, DispatchKey.AutogradOther):
        excluded = excluded.remove(key)
    with torch._C._ForceDispatchKeyGuard(included, excluded), torch.enable_grad():
        yield


# The project's custom ops (torch.library.custom_op: opaque to torch.compile, so their fake kernels must say what
# the real ones return) -> a function giving sample arguments laid out as the layers pass them. The test suite
# runs torch.library.opcheck on every op of the project with these, its CPU stand-in as the kernel that runs
# (tests/models/test_gpu_sim.py); an op without samples fails there.
OPCHECK_SAMPLES: dict = {}


def opcheck_samples(qualname: str):
    """Decorator: fn() -> a list of argument tuples for the custom op `qualname` (namespace::name)."""
    def register(fn):
        OPCHECK_SAMPLES[qualname] = fn
        return fn
    return register
