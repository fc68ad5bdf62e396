"""Peak FLOP/s of a GPU, for the model FLOPs utilisation (MFU) that training and the benchmarks report."""

from __future__ import annotations

import torch

# dense (no sparsity) bf16 tensor-core peak FLOP/s with float32 accumulation by device name, for MFU (float32
# runs use the TF32 peak: half of it). GeForce cards accumulate in float32 at half their fp16-accumulate rate:
# the RTX 3090's 71 TFLOP/s (GA102 whitepaper: bf16 and fp16 with fp32 accumulate 71, fp16 accumulate 142,
# TF32 35.6) and the RTX 4090's 165 are those figures. The first entry whose key is in torch.cuda.get_device_name() wins, so the H100's form
# factors come before the plain "H100" (the SXM part, e.g. "NVIDIA H100 80GB HBM3"): the PCIe card and
# the NVL part run at lower clocks and power.
PEAK_FLOPS = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12),
              ("GH200", 989e12), ("H800", 989e12), ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12),
              ("L40S", 362e12), ("L40", 181e12), ("L4", 121e12), ("A10G", 125e12), ("RTX 4090", 165e12),
              ("RTX 3090", 71e12), ("V100", 125e12), ("A6000", 155e12))


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    if device.type != "cuda":
        return None  # CPU peaks vary too much to be worth a table: report tokens/s only
    return peak_flops_of(torch.cuda.get_device_name(device), dtype)


def peak_flops_of(device_name: str, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of a GPU by its name (None when unknown: MFU is then not reported)."""
    peak = next((v for k, v in PEAK_FLOPS if k in device_name), None)
    return peak if peak is None or dtype != torch.float32 else peak / 2
