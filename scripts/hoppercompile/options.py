"""What the Hopper compile report compiles: the sizes and dtype of the launches, and where it writes."""

from dataclasses import dataclass

from attention.moba import MOBA_BLOCK, MOBA_TOPK


@dataclass
class HopperConfig:
    batch: int = 4
    heads: int = 16
    kv_heads: int = 0  # key/value heads (grouped-query attention); 0: as many as heads
    length: int = 32768
    head_dim: int = 64
    dtype: str = "bfloat16"  # the inputs' dtype: bfloat16 as training runs (autocast), or float32
    moba_block: int = MOBA_BLOCK.default
    moba_topk: int = MOBA_TOPK.default
    jobs: int = 0  # kernels compiled at once, one process each; 0: one per core
    json: str = ""
    sass: str = ""  # a folder to write each kernel's SASS into (nvdisasm), numbered as the rows


SASS_MARKER = ".hopper_compile"  # marks a --sass folder as this tool's own
