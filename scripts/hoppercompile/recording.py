"""Kernel launches recorded instead of run: every Triton function of the ops' kernel modules replaced by a
recorder, so an op's Python code leaves the launches it would make."""

import contextlib
from dataclasses import dataclass

import torch

from attention.ops.moba import op as moba_op
from attention.ops.span import op as span_op
from scripts.hoppercompile.standins import CudaStandIn

# Triton is imported inside the functions that use it: --help and ptxas_problem must work where it is absent


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
