"""Local attention variants defined by one edge rule each: full causal, sliding window, fixed blocks."""

from __future__ import annotations

from attention.edges import Causal, FixedBlock, SlidingWindow
from attention.layer import MaskedAttention
from attention.registry import Setting, refuse_whole_context, register

SWA_WINDOW = Setting("swa_window", int, 256, "swa(w): the w most recent positions, the query included")
BLOCK_LEN = Setting("block_len", int, 128, "block(b): causal attention within fixed blocks of b positions")


@register("full")
class CausalSelfAttention(MaskedAttention):
    """Every earlier position (auto backend: PyTorch SDPA, flash / memory-efficient kernels)."""
    paper = ""
    summary = "j <= i"

    @classmethod
    def check_config(cls, config):
        super().check_config(config)
        if config.attn_backend == "chunked":
            raise ValueError("attn_backend=chunked is for rules that skip keys: full attention reads every earlier "
                             "key, which SDPA's fused kernels do faster; use attn_backend=auto (sdpa), flex or dense")

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx, Causal())


@register("swa")
class SlidingWindowAttention(MaskedAttention):
    """The swa_window most recent positions, the query included."""
    paper = "001, 002, 003"
    summary = "0 <= i - j < w: the w most recent positions, i itself included"

    settings = MaskedAttention.settings + (SWA_WINDOW,)

    @classmethod
    def check_config(cls, config):
        super().check_config(config)
        if config.swa_window < 1:
            raise ValueError(f"swa_window={config.swa_window}: must be >= 1")
        refuse_whole_context(config, "swa_window", config.swa_window, "the window reaches back over")

    @classmethod
    def example_settings(cls, window):
        return {"swa_window": window}

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx, SlidingWindow(config.swa_window))

    def set_window(self, window):
        # only the rule changes: kernels cache masks per rule, so each distinct window is built (and, under
        # torch.compile, traced) once and switching between windows afterwards costs nothing
        self.rule = SlidingWindow(window)
        return True


@register("block")
class BlockAttention(MaskedAttention):
    """Causal attention within fixed blocks of block_len positions."""
    paper = "004"
    summary = "j <= i and floor(i / b) == floor(j / b)"

    settings = MaskedAttention.settings + (BLOCK_LEN,)

    @classmethod
    def check_config(cls, config):
        super().check_config(config)
        if config.block_len < 1:
            raise ValueError(f"block_len={config.block_len}: must be >= 1")
        refuse_whole_context(config, "block_len", config.block_len, "one block holds")

    @classmethod
    def example_settings(cls, window):
        return {"block_len": window}

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx, FixedBlock(config.block_len))
