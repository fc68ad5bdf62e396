"""The GPU check's first step: the versions it runs on, and whether the GPU kernels can run (environment.py)."""

from scripts.gpucheck.context import StepContext, outcome
from scripts.gpucheck.environment import environment, gpu_kernel_problems


def step_preflight(ctx: StepContext) -> dict:
    """Versions, and whether the GPU kernels can run: a second."""
    env = environment(ctx.device)
    kernels = ", ".join(f"{k} {v}" for k, v in env["optional_kernels"].items())
    summary = f"torch {env['torch']}" + (f", CUDA {env['cuda']}" if env["cuda"] else "") + f"; {kernels}"
    results = {key: env[key] for key in ("torch", "cuda", "optional_kernels", "triton_pin", "triton_block_ptr",
                                         "gpus")}
    problems = gpu_kernel_problems(ctx.device, env)
    if problems:
        return outcome("failed", summary, results, "\n".join(problems))
    on_cpu = " (the GPU kernels' CPU stand-ins: simulated CUDA)" if ctx.gpu_path else \
        " (the GPU kernels are not needed on CPU)"
    return outcome("passed", summary + ("" if ctx.device == "cuda" else on_cpu), results)
