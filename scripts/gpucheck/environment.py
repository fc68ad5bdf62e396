"""What the GPU check runs on: the device, torch, CUDA and the GPU kernel packages' versions, and whether the
installed Triton has what those packages build with (the preflight step's checks)."""

import importlib.metadata
import os
import platform
import re
from pathlib import Path

import torch

from runtime.checkpoint import git_hash
from scripts.gpucheck.options import gpu_kernel_mixers


def torch_triton_pin() -> str:
    """The Triton version the installed torch was built against (its wheel's requirement), or ""."""
    for requirement in importlib.metadata.requires("torch") or []:
        name, _, rest = requirement.partition("==")
        if name.strip() in ("triton", "pytorch-triton") and rest:
            return rest.split(";")[0].strip()
    return ""


def gpu_kernel_problems(device: str, env: dict) -> list[str]:
    """Why the GPU kernels of the recurrent mixers cannot run here, each with its fix (none off CUDA). A missing
    package is a failure on a GPU, not a silent fallback to the built-in forms: the check exists to run them."""
    if device != "cuda":
        return []
    versions, problems = env["optional_kernels"], []
    for package in sorted({kernel[2] for kernel in gpu_kernel_mixers().values()}):  # requirements-gpu.txt
        if versions.get(package, "not installed") == "not installed":
            problems.append(f"{package} is not installed: pip install -r requirements-gpu.txt")
    pin = env.get("triton_pin") or "the version torch pins"
    if versions.get("triton") == "not installed":
        problems.append(f"triton is not installed: pip install triton=={pin} (torch {env['torch']}'s pin)")
    elif not env.get("triton_block_ptr"):
        problems.append(f"Triton {versions.get('triton')} has no tl.make_block_ptr, which mlstm_kernels and fla build "
                        f"their kernels with (Triton 3.9 removed it): pip install triton=={pin}, the version torch "
                        f"{env['torch']} pins, and keep it there (requirements-gpu.txt)")
    elif wrong_triton_for_hopper((env.get("capability") or [0])[0], versions["triton"]):
        problems.append(f"Triton {versions['triton']} on a Hopper GPU ({env['device_name']}): Triton 3.4.0 to 3.7.0 "
                        "compile gated chunked backward kernels wrongly on Hopper (fla issue #640: fla's Gated "
                        "DeltaNet refuses to run its backward there; mlstm_kernels' backward differed from the "
                        "reference in up to 1.4% of the gradients' elements on an H200 with Triton 3.6.0): install "
                        "torch==2.13.0, which brings Triton 3.7.1, as requirements.txt pins")
    return problems


# Triton versions that compile fla's gated chunked backward wrongly on Hopper (fla/ops/common/chunk_o.py refuses
# them, citing fla issue #640): [from, to)
HOPPER_WRONG_TRITON = ((3, 4, 0), (3, 7, 1))


def wrong_triton_for_hopper(major: int, triton_version: str) -> bool:
    """Whether a GPU of compute capability major.x runs a Triton that compiles gated chunked backward kernels
    wrongly there (Hopper, HOPPER_WRONG_TRITON)."""
    return major == 9 and HOPPER_WRONG_TRITON[0] <= version_tuple(triton_version) < HOPPER_WRONG_TRITON[1]


def version_tuple(version: str) -> tuple[int, ...]:
    """(3, 6, 0) for "3.6.0" or "3.6.0+git1234": the release's numbers, for comparisons."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def environment(device: str) -> dict:
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        name, memory = torch.cuda.get_device_name(0), f"{props.total_memory / 2**30:.1f} GiB"
    else:
        model = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                      if line.startswith("model name")), platform.processor() or "CPU")
        name, memory = f"CPU: {model} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)", ""
    optional = {}  # Triton, each registered GPU kernel's package (the mixer's gpu_kernel), and fla's kernels
    for package in ("triton", *sorted({kernel[2] for kernel in gpu_kernel_mixers().values()}), "fla-core"):
        try:
            optional[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            optional[package] = "not installed"
    block_ptr = None
    if optional["triton"] != "not installed":
        try:
            import triton.language

            block_ptr = hasattr(triton.language, "make_block_ptr")
        except Exception:  # a broken Triton install: reported as lacking it
            block_ptr = False
    return {"device": device, "device_name": name, "device_memory": memory, "torch": str(torch.__version__),
            "cuda": torch.version.cuda or "", "python": platform.python_version(), "optional_kernels": optional,
            "triton_pin": torch_triton_pin(), "triton_block_ptr": block_ptr,
            "gpus": torch.cuda.device_count() if device == "cuda" else 0, "git_hash": git_hash(),
            "capability": list(torch.cuda.get_device_capability(0)) if device == "cuda" else []}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""
