"""window_sinks: the swa_window most recent positions plus the first 4 (attention sinks, StreamingLLM), written
as allowed() alone. The kernels find its cost from the rule: each query chunk's tile holds the 4 sink keys and
its window (compacted key tiles), about swa(w)'s keys per query."""

from dataclasses import dataclass

from attention.edges import EdgeRule
from attention.layer import MaskedAttention
from attention.local import SWA_WINDOW
from attention.registry import register


@dataclass(frozen=True)
class WindowAndSinks(EdgeRule):
    window: int = 256
    sinks: int = 4

    def allowed(self, q, k, h=None):
        return (k <= q) & ((q - k < self.window) | (k < self.sinks))


@register("window_sinks")
class WindowSinksAttention(MaskedAttention):
    settings = MaskedAttention.settings + (SWA_WINDOW,)

    @classmethod
    def example_settings(cls, window):
        return {"swa_window": window}

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx, WindowAndSinks(config.swa_window))
