"""longformer: Longformer's sliding window with global tokens (Beltagy et al. 2020), written as allowed() alone:
every query sees its swa_window most recent positions; every swa_window-th position is global, attending to
every earlier position and attended by every later one. A few rows attend everywhere: the kernels find them
from the rule and run them apart (attention/layouts.py: wide rows), so the window rows keep swa's tiles and the
rule costs about what its edges cost."""

from dataclasses import dataclass

from attention.edges import EdgeRule
from attention.layer import MaskedAttention
from attention.local import SWA_WINDOW
from attention.registry import register


@dataclass(frozen=True)
class WindowAndGlobalTokens(EdgeRule):
    window: int = 256
    stride: int = 256

    def allowed(self, q, k, h=None):
        is_global = lambda t: t % self.stride == 0  # noqa: E731
        return (k <= q) & ((q - k < self.window) | is_global(q) | is_global(k))


@register("longformer")
class LongformerAttention(MaskedAttention):
    settings = MaskedAttention.settings + (SWA_WINDOW,)

    @classmethod
    def example_settings(cls, window):
        return {"swa_window": window}

    def __init__(self, config, layer_idx):  # a global token every window: the stride of the benchmarks
        super().__init__(config, layer_idx, WindowAndGlobalTokens(config.swa_window, config.swa_window))
