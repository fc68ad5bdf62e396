"""Rotary position embedding (half-split layout, as in GPT-NeoX and Llama)."""

import torch


def apply_rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate x (..., T, D) by the angles of positions pos (T,). Computed in float32 (float64 for float64 x, so that
    the rotation is exact to its precision: a float64 model's outputs then depend on relative positions alone to
    float64 rounding), returned in x's dtype."""
    dim = x.shape[-1]
    compute = torch.promote_types(x.dtype, torch.float32)
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = pos.to(compute)[:, None] * inv_freq.to(compute)[None, :]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.to(compute).chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
