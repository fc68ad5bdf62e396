"""fixed_pattern: the Sparse Transformer's "fixed" attention (Child et al. 2019): a query sees its own block of
block_len positions causally, plus the last position of every earlier block (the summary column), written as
allowed() alone. Every earlier key block holds an edge, so a block-sparse layout is dense; the chunked kernel's
compacted tiles hold only the keys with edges (its own block and one summary key per earlier block)."""

from dataclasses import dataclass

from attention.edges import EdgeRule
from attention.layer import MaskedAttention
from attention.local import BLOCK_LEN
from attention.registry import register


@dataclass(frozen=True)
class FixedPattern(EdgeRule):
    block: int = 128

    def allowed(self, q, k, h=None):
        own_block = q // self.block == k // self.block
        summary = k % self.block == self.block - 1
        return (k <= q) & (own_block | summary)


@register("fixed_pattern")
class FixedPatternAttention(MaskedAttention):
    settings = MaskedAttention.settings + (BLOCK_LEN,)

    @classmethod
    def example_settings(cls, window):
        return {"block_len": window}

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx, FixedPattern(config.block_len))
