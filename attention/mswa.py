"""Multi-scale window attention (paper 002): sliding windows that differ across heads and layers.

With base window w (swa_window), the layers of the MSWA family are split into four equal depth groups with
base windows w_l = w/4, w/2, w, 2w from shallow to deep, and each layer's heads into four equal groups with
windows w_l/4, w_l/2, w_l, 2w_l (Table 1: 8..512 for w = 128). `mswa_h` varies only the heads (w_l = w),
`mswa_l` only the layers. Ablations (Table 6): mswa_layer_order=reverse (windows decrease with depth) and
mswa_variation=arithmetic (groups scaled by 1/2, 3/4, 1, 5/4 instead of 1/4, 1/2, 1, 2, for the layer groups
and the head groups alike). In a hybrid pattern the depth groups are taken over the MSWA layers only.
Each layer is attention under a HeadWindows rule; its kernels run each group of heads at its own window.
"""

from __future__ import annotations

from fractions import Fraction

from attention.edges import HeadWindows
from attention.layer import MaskedAttention
from attention.local import SWA_WINDOW
from attention.registry import Setting, layer_names, register

MSWA_VARIATION = Setting("mswa_variation", str, "geometric", "mswa: group factors 1/4,1/2,1,2 (geometric) or "
                         "1/2,3/4,1,5/4 (arithmetic)")
MSWA_LAYER_ORDER = Setting("mswa_layer_order", str, "increasing", "mswa: windows grow with depth (increasing) or "
                           "shrink (reverse)")

FACTORS = {"geometric": (Fraction(1, 4), Fraction(1, 2), Fraction(1), Fraction(2)),
           "arithmetic": (Fraction(1, 2), Fraction(3, 4), Fraction(1), Fraction(5, 4))}
VARIES = {"mswa": (True, True), "mswa_h": (False, True), "mswa_l": (True, False)}  # (layers, heads)


def mswa_windows(config, layer_idx: int) -> tuple[int, ...]:
    """The window of every head of layer layer_idx under the config's MSWA schedule."""
    names = layer_names(config)
    vary_layers, vary_heads = VARIES[names[layer_idx]]
    factors = FACTORS[config.mswa_variation]
    family = [i for i, name in enumerate(names) if name in VARIES]
    base = Fraction(config.swa_window)
    if vary_layers:
        group = family.index(layer_idx) * 4 // len(family)
        if config.mswa_layer_order == "reverse":
            group = 3 - group
        base *= factors[group]
    windows = []
    for head in range(config.n_head):
        window = base * factors[head * 4 // config.n_head] if vary_heads else base
        if window.denominator != 1 or window < 1:
            raise ValueError(f"swa_window={config.swa_window} gives a window of {float(window)} under the "
                             f"{config.mswa_variation} MSWA schedule: use a base window divisible by 16")
        windows.append(int(window))
    return tuple(windows)


class MultiScaleWindowAttention(MaskedAttention):
    paper = "002"
    summary = "sliding windows that differ by head (`mswa_h`), layer (`mswa_l`) or both (`mswa`; Table 1)"
    settings = MaskedAttention.settings + (SWA_WINDOW, MSWA_VARIATION, MSWA_LAYER_ORDER)

    @classmethod
    def check_config(cls, config):
        super().check_config(config)
        if config.mswa_variation not in FACTORS:
            raise ValueError(f"mswa_variation={config.mswa_variation!r}: expected geometric or arithmetic")
        if config.mswa_layer_order not in ("increasing", "reverse"):
            raise ValueError(f"mswa_layer_order={config.mswa_layer_order!r}: expected increasing or reverse")
        names = layer_names(config)
        family = [i for i, name in enumerate(names) if name in VARIES]
        if any(VARIES[names[i]][0] for i in family) and len(family) % 4:
            raise ValueError(f"MSWA splits its {len(family)} layers into 4 equal depth groups: use a multiple of 4 "
                             "MSWA layers (or mswa_h, which varies heads only)")
        if any(VARIES[names[i]][1] for i in family) and config.n_head % 4:
            raise ValueError(f"MSWA splits heads into 4 equal groups: n_head={config.n_head} is not a multiple of 4 "
                             "(or use mswa_l, which varies layers only)")
        longest = max(max(mswa_windows(config, i)) for i in family)
        if longest >= config.block_size:
            raise ValueError(f"the MSWA schedule of swa_window={config.swa_window} gives windows up to {longest}, at "
                             f"least block_size={config.block_size}: those heads would be full attention in training. "
                             f"Use block_size > {longest} (e.g. {2 * longest}, with fewer sequences per step) or a "
                             "smaller swa_window")

    @classmethod
    def example_settings(cls, window):
        # four depth groups of layers; windows reach 4x the base, so half of `window` keeps them near it
        return {"swa_window": max(4, window // 2), "n_layer": 4}

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx, HeadWindows(mswa_windows(config, layer_idx)))

    def describe(self):
        return "windows per head: " + " ".join(map(str, self.rule.windows))


for _name in VARIES:
    register(_name)(type(f"MSWA_{_name}", (MultiScaleWindowAttention,), {}))
