"""dilated_window: Longformer's dilated sliding window, written as allowed() alone. Head groups have dilations
1, 2, 4, 8 (n_head split in four): head h sees swa_window keys at q, q - d, q - 2d, ... Its span d w makes every
key block in it live, but every offset is a multiple of d: the kernels find that from the rule and run each
residue class mod d as a sequence of its own, where the head is a sliding window of w keys (attention/layouts.py)."""

from dataclasses import dataclass

from attention.edges import EdgeRule, head_values
from attention.layer import MaskedAttention
from attention.local import SWA_WINDOW
from attention.registry import register

DILATIONS = (1, 2, 4, 8)


@dataclass(frozen=True)
class DilatedWindow(EdgeRule):
    window: int = 64
    dilations: tuple = (1, 1, 2, 2, 4, 4, 8, 8)  # per head
    per_head = True

    def allowed(self, q, k, h=None):
        d = head_values(self.dilations, h)
        return (k <= q) & ((q - k) % d == 0) & (q - k < d * self.window)


@register("dilated_window")
class DilatedWindowAttention(MaskedAttention):
    settings = MaskedAttention.settings + (SWA_WINDOW,)

    @classmethod
    def check_config(cls, config):
        super().check_config(config)
        if config.n_head % len(DILATIONS):
            raise ValueError(f"dilated_window splits heads into {len(DILATIONS)} groups: use n_head divisible by "
                             f"{len(DILATIONS)} (n_head={config.n_head})")

    @classmethod
    def example_settings(cls, window):
        return {"swa_window": window}

    def __init__(self, config, layer_idx):
        per_group = config.n_head // len(DILATIONS)
        super().__init__(config, layer_idx, DilatedWindow(config.swa_window,
                                                          tuple(d for d in DILATIONS for _ in range(per_group))))
