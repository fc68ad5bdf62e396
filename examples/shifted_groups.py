"""shifted_groups: LongLoRA's shifted sparse attention (S2-Attn, Chen et al. 2024), causal, written as allowed()
alone: tokens in groups of block_len; the first half of the heads attend causally within their group, the second
half within groups shifted by block_len / 2, so that information crosses group boundaries. A per-head rule whose
allowed() leaves out the head axis where its heads agree (head_values gives an int then); the kernels group the
heads with the same edges from allowed() itself and run each group at its own cost."""

from dataclasses import dataclass

from attention.edges import EdgeRule, head_values
from attention.layer import MaskedAttention
from attention.local import BLOCK_LEN
from attention.registry import register, refuse_whole_context


@dataclass(frozen=True)
class ShiftedGroups(EdgeRule):
    group: int = 128
    shifts: tuple = (0, 64)  # per head: how far its groups are moved
    per_head = True

    @property
    def lookback(self):  # a property: it follows the fields
        return self.group - 1

    def allowed(self, q, k, h=None):
        shift = head_values(self.shifts, h)  # python ints in, so compiled FlexAttention can lower the mask
        return (k <= q) & ((q + shift) // self.group == (k + shift) // self.group)


@register("shifted_groups")
class ShiftedGroupsAttention(MaskedAttention):
    settings = MaskedAttention.settings + (BLOCK_LEN,)

    @classmethod
    def check_config(cls, config):  # checks across settings (a value's own range: its Setting's check=)
        super().check_config(config)
        refuse_whole_context(config, "block_len", config.block_len, "a group covers")
        if config.n_head % 2 or config.block_len % 2:
            raise ValueError(f"shifted_groups shifts half the heads by half a group: use an even n_head and "
                             f"block_len (n_head={config.n_head}, block_len={config.block_len})")

    @classmethod
    def example_settings(cls, window):  # the tools' small models: a group as long as their window
        return {"block_len": window}

    def __init__(self, config, layer_idx):
        half = config.n_head // 2
        shifts = (0,) * half + (config.block_len // 2,) * half
        super().__init__(config, layer_idx, ShiftedGroups(config.block_len, shifts))
