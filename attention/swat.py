"""SWAT (paper 001): sigmoid sliding-window attention with balanced ALiBi and RoPE.

    o_i = sum_{0 <= i-j < w} sigmoid(q_i . k_j / sqrt(d) + s_h (i - j) + b) v_j

q and k are rotated by RoPE when swat_rope (the paper's AliRope); s_h is head h's ALiBi slope; b a constant
bias (0 by default; "-log(w)" takes the window in use, so an evaluation with another window gets that
window's b); the output is not normalised. swat_activation=softmax gives the
softmax counterpart with the same position options, for the paper's ablations (Table 3).

Slopes follow the paper's sign convention: the bias is s_h (i - j), so a negative slope is classic ALiBi
(favours recent keys) and a positive one favours older keys. swat_split="neg:pos" says how many heads get
each sign (under `paper` the first `neg` heads are negative). Magnitudes:
    paper  2^-k, k = 1..count within each direction (Eq. 4: 6:6 gives -1/2..-1/64 and +1/2..+1/64)
    alibi  the authors' code (their flash-linear-attention fork, fla/layers/sig_attn.py, get_alibi_slope):
           ALiBi's magnitudes 2^(-8k/H) with H all heads, k restarting at 1 in each direction; as there, the
           positive heads come first (k = 1..pos), then the negative ones in increasing magnitude (k = neg..1).
           12:0 is the original ALiBi ("traditional ALiBi slopes", 001 App. C.3: Table 3's ALiBi-12:0 and
           SWAT (-)/(+)). Their code's slopes are flash-attention's, which subtract slope * (i - j): its
           negative values are this module's positive slopes.
    none   no ALiBi (RoPE alone, or no position information at all)
The bias lives in the kernels as a ScoreBias (attention/ops/score_mod.py), computed inside each chunk, never as
an n x n matrix. Sliding-window training is plain: block_size (the training length T) is independent of
swa_window (w), and evaluation may use other lengths and windows (python -m eval --ppl_windows).
"""

from __future__ import annotations

import math

import torch

from attention.local import SlidingWindowAttention
from attention.ops.score_mod import ScoreBias
from attention.registry import Setting, register

SWAT_ACTIVATION = Setting("swat_activation", str, "sigmoid", "swat: sigmoid (paper 001, no normalisation) | softmax "
                          "(the ablations' counterpart)")
SWAT_ROPE = Setting("swat_rope", bool, True, "swat: RoPE on q, k (with ALiBi: the paper's AliRope); False: ALiBi alone")
SWAT_SLOPES = Setting("swat_slopes", str, "paper", "swat ALiBi magnitudes: paper (2^-k, k = 1.. per direction) | alibi "
                      "(the authors' code: 2^(-8k/H), k = 1.. per direction) | none")
SWAT_SPLIT = Setting("swat_split", str, "", 'swat "neg:pos" heads with negative (classic ALiBi) and positive slopes; '
                     '"": half and half')
SWAT_BIAS = Setting("swat_bias", str, "0", 'swat constant score bias b: a number, or "-log(w)"')

ACTIVATIONS = ("sigmoid", "softmax")
SLOPE_SCHEDULES = ("paper", "alibi", "none")


def parse_split(split: str, n_head: int) -> tuple[int, int]:
    """(heads with negative slopes, heads with positive slopes) from "neg:pos" ("" = half and half)."""
    if not split:
        if n_head % 2:
            raise ValueError(f"swat_split='' splits the heads half and half, but n_head={n_head} is odd: "
                             f"give swat_split explicitly, e.g. '{n_head // 2 + 1}:{n_head // 2}'")
        return n_head // 2, n_head // 2
    try:
        neg, pos = (int(part) for part in split.split(":"))
    except ValueError:
        raise ValueError(f"swat_split={split!r}: expected 'neg:pos' head counts such as '6:6' or '12:0'") from None
    if neg < 0 or pos < 0 or neg + pos != n_head:
        raise ValueError(f"swat_split={split!r}: the two counts must be >= 0 and add up to n_head={n_head}")
    return neg, pos


def swat_slopes(n_head: int, schedule: str = "paper", split: str = "") -> list[float]:
    """The ALiBi slope s_h of every head (bias s_h * (i - j); negative = classic ALiBi)."""
    if schedule == "none":
        return [0.0] * n_head
    neg, pos = parse_split(split, n_head)
    if schedule == "paper":
        return [-2.0 ** -k for k in range(1, neg + 1)] + [2.0 ** -k for k in range(1, pos + 1)]
    if schedule == "alibi":
        magnitude = lambda k: 2.0 ** (-8 * k / n_head)
        return [magnitude(k) for k in range(1, pos + 1)] + [-magnitude(k) for k in range(neg, 0, -1)]
    raise ValueError(f"swat_slopes={schedule!r}: expected one of {', '.join(SLOPE_SCHEDULES)}")


def parse_bias(text: str, window: int) -> float:
    """The constant score bias b: a number, or -log(w)."""
    if text.replace(" ", "") == "-log(w)":
        return -math.log(window)
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"swat_bias={text!r}: expected a number or '-log(w)'") from None


class AlibiBias(ScoreBias):
    """score + s_h (q - k) + b: ALiBi with signed per-head slopes and a constant offset."""

    relative = True

    def __init__(self, slopes: torch.Tensor, offset: float):
        self.slopes, self.offset = slopes, offset

    def bias(self, h, q_idx, kv_idx):
        return self.slopes[h] * (q_idx - kv_idx) + self.offset

    def alibi(self):
        return self.slopes, self.offset


@register("swat")
class SigmoidWindowAttention(SlidingWindowAttention):
    """swa's window with SWAT's scores: sigmoid (or softmax), ALiBi slopes, optional RoPE and bias."""
    paper = "001"
    summary = "0 <= i - j < w, weighted by sigmoid(q.k/sqrt(d) + s_h (i - j) + b), no normalisation"

    settings = SlidingWindowAttention.settings + (SWAT_ACTIVATION, SWAT_ROPE, SWAT_SLOPES, SWAT_SPLIT, SWAT_BIAS)
    check_variants = {"softmax": {"swat_activation": "softmax"}}  # the ablations' counterpart

    @classmethod
    def check_config(cls, config):
        super().check_config(config)  # the window
        if config.swat_activation not in ACTIVATIONS:
            raise ValueError(f"swat_activation={config.swat_activation!r}: expected sigmoid or softmax")
        slopes = swat_slopes(config.n_head, config.swat_slopes, config.swat_split)
        if config.swat_slopes == "none" and config.swat_split:
            raise ValueError(f"swat_split={config.swat_split!r} has no effect with swat_slopes=none: leave it empty "
                             "or choose paper or alibi slopes")
        offset = parse_bias(config.swat_bias, config.swa_window)
        has_bias = any(slopes) or offset != 0
        if config.attn_backend == "sdpa" and (config.swat_activation == "sigmoid" or has_bias):
            raise ValueError("attn_backend=sdpa has neither sigmoid attention nor score biases: use auto, chunked, "
                             "flex or dense")

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.activation = config.swat_activation
        # RoPE is this layer's choice (swat_rope), whatever the model's default position embedding
        self.rope_theta = config.rope_theta if config.swat_rope else None
        self.slopes = swat_slopes(config.n_head, config.swat_slopes, config.swat_split)
        self.bias_text = config.swat_bias
        self.offset = parse_bias(config.swat_bias, config.swa_window)
        self.has_bias = any(self.slopes) or self.offset != 0
        # (device, offset) -> AlibiBias: slopes stay float32 whatever the model's dtype, and each window's bias
        # is one object, so compiled flex sees a known score_mod when the window switches back
        self._score_mods = {}

    def set_window(self, window):
        self.offset = parse_bias(self.bias_text, window)  # "-log(w)" follows the window in use
        self.has_bias = any(self.slopes) or self.offset != 0
        return super().set_window(window)

    def score_mod(self, device):
        if not self.has_bias:
            return None
        key = (str(device), self.offset)
        if key not in self._score_mods:
            self._score_mods[key] = AlibiBias(torch.tensor(self.slopes, dtype=torch.float32, device=device),
                                                 self.offset)
        return self._score_mods[key]

    def describe(self):
        slopes = " ".join(f"{s:+g}" for s in self.slopes)
        rope = "RoPE" if self.rope_theta is not None else "no RoPE"
        return f"{self.activation}, {rope}, bias {self.offset:+g}, ALiBi slopes per head: {slopes}"
