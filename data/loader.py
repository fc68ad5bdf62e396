"""Training and validation windows drawn from a prepared token memmap.

The batch of a training step is a pure function of (seed, step): the step's global set of windows is
drawn from a generator seeded by both, and micro-step m of rank r takes its own slice of that set. So
  - runs are deterministic per seed, and resuming needs only the step as the cursor;
  - DDP ranks never see the same window, and a run with W ranks trains on exactly the windows of a
    single-process run with the same global batch (batch_size * gradient_accumulation_steps).
Validation uses one fixed set of windows (independent of the seed), split across ranks the same way.
"""

from __future__ import annotations

import numpy as np
import torch

from data.meta import open_tokens

_VAL_SEED = 0x5EED  # validation windows are the same for every run on the same data


class WindowSampler:
    def __init__(self, data_dir: str, split: str, block_size: int, batch_size: int, micro_steps: int,
                 rank: int = 0, world_size: int = 1, seed: int = 0, device: str = "cpu",
                 loss_after: int | None = None):
        """micro_steps: the global number of micro-batches per step (gradient_accumulation_steps).
        loss_after: a token id; when given, only targets whose input token is it count (others are -1)."""
        self.tokens = open_tokens(data_dir, split)
        self.split = split
        self.block_size, self.batch_size = block_size, batch_size
        self.micro_steps, self.rank, self.world_size = micro_steps, rank, world_size
        self.seed, self.device, self.loss_after = seed, device, loss_after
        self.num_windows = len(self.tokens) - block_size  # each window needs block_size + 1 tokens
        if self.num_windows < 1:
            raise ValueError(f"the {split} split has {len(self.tokens)} tokens, fewer than block_size + 1 = "
                             f"{block_size + 1}: lower block_size or prepare more data")
        if micro_steps % world_size:
            raise ValueError(f"gradient_accumulation_steps={micro_steps} is not divisible by the number of "
                             f"processes ({world_size}); choose a multiple of {world_size}")
        self.local_micro_steps = micro_steps // world_size

    def _offsets(self, step: int) -> np.ndarray:
        """Start offsets of every window of a step, for all ranks and micro-steps together."""
        seed = _VAL_SEED if self.split == "val" else self.seed
        rng = np.random.default_rng([seed, step])
        return rng.integers(0, self.num_windows, size=self.micro_steps * self.batch_size)

    def get(self, step: int, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets (batch_size, block_size) for this rank's micro_step of step."""
        return self.batch(step, micro_step * self.world_size + self.rank)

    def batch(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The index-th micro-batch of a step's global set of windows."""
        offsets = self._offsets(step)[index * self.batch_size:(index + 1) * self.batch_size]
        windows = np.stack([self.tokens[o:o + self.block_size + 1] for o in offsets]).astype(np.int64)
        chunk = torch.from_numpy(windows)
        x, y = chunk[:, :-1], chunk[:, 1:]
        if self.loss_after is not None:
            y = y.masked_fill(x != self.loss_after, -1)  # the model's loss ignores targets < 0
        if self.device.startswith("cuda"):
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    def state_dict(self, step: int) -> dict:
        return {"split": self.split, "seed": self.seed, "step": step, "block_size": self.block_size,
                "batch_size": self.batch_size, "micro_steps": self.micro_steps}
