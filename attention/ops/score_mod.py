"""The score_mod every kernel takes: FlexAttention's `score_mod(score, b, h, q_idx, kv_idx)` over absolute
positions, so that one definition serves all backends; and ScoreBias, the additive kind the fused kernels take
on their fast paths."""

from __future__ import annotations


class ScoreBias:
    """A score_mod that adds bias(h, q_idx, kv_idx) to every score, independent of the score and the batch
    (ALiBi and other position biases). It is an ordinary FlexAttention score_mod; kernels that can add a
    precomputed bias tile (the fused CPU paths) recognise it and keep their fast path. `relative`: the bias
    depends on q_idx - kv_idx only, so one tile serves every chunk."""

    relative = False

    def bias(self, h, q_idx, kv_idx):
        raise NotImplementedError

    def alibi(self):
        """(slopes (H,) float32, offset) when the bias is slopes[h] (q - k) + offset, which span attention computes
        inside its kernel; None for any other bias."""
        return None

    def __call__(self, score, b, h, q_idx, kv_idx):
        return score + self.bias(h, q_idx, kv_idx)
