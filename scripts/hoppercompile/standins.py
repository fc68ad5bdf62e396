"""Stand-in CUDA tensors: meta tensors that say they are on CUDA, so the ops' launch code takes its GPU branches
on a machine without a GPU and allocates nothing."""

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

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
