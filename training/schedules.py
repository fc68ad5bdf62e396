"""What changes from step to step: the learning rate (warmup, then cosine decay) and the per-step hooks that change
the model between steps (paper 003's window schedule)."""

import math
import random

from config import Config


def get_lr(step: int, t) -> float:
    """Linear warmup to learning_rate, then cosine decay to min_lr at lr_decay_iters (max_iters when 0), then
    min_lr."""
    if not t.decay_lr:
        return t.learning_rate
    if step < t.warmup_iters:
        return t.learning_rate * (step + 1) / (t.warmup_iters + 1)
    decay_iters = t.lr_decay_iters or t.max_iters
    if step >= decay_iters:
        return t.min_lr
    progress = (step - t.warmup_iters) / max(1, decay_iters - t.warmup_iters)
    return t.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (t.learning_rate - t.min_lr)


def schedule_warning(t) -> str:
    """A line when an explicit lr_decay_iters leaves the decay far from max_iters ("" otherwise): then much of
    training runs at min_lr, or it ends before the learning rate has decayed."""
    if not t.decay_lr or not t.lr_decay_iters or abs(t.lr_decay_iters - t.max_iters) <= 0.01 * t.max_iters:
        return ""
    if t.lr_decay_iters < t.max_iters:
        effect = (f"the learning rate reaches min_lr at step {t.lr_decay_iters} and stays there for the last "
                  f"{1 - t.lr_decay_iters / t.max_iters:.0%} of training")
    else:
        effect = f"training ends at {t.max_iters / t.lr_decay_iters:.0%} of the decay, before min_lr"
    return (f"warning: lr_decay_iters={t.lr_decay_iters} but max_iters={t.max_iters}: {effect}; set "
            f"--lr_decay_iters={t.max_iters}, or 0 to follow max_iters")


def window_for_step(step: int, t, long_window: int) -> int:
    """The sliding window of a training step (paper 003). stochastic: swax_short_window with probability
    swax_short_prob, else the long window, and only the long one in the last swax_anneal_frac of max_iters.
    A function of (seed, step) alone, so a resumed run draws exactly what the uninterrupted one drew."""
    if t.window_schedule == "fixed" or step >= (1 - t.swax_anneal_frac) * t.max_iters:
        return long_window
    draw = random.Random(f"{t.seed}:window:{step}").random()  # str seeds are hashed with SHA-512: stable
    return t.swax_short_window if draw < t.swax_short_prob else long_window


class WindowSchedule:
    """Paper 003's stochastic window training, as a per-step hook of the loop: each step trains with the window
    window_for_step draws (a function of seed and step), evaluation uses the long (test-time) window, and every
    step's window is logged. Only the layers' edge rule changes (attention/local.py)."""

    def __init__(self, t, long_window: int):
        self.t, self.long_window = t, long_window

    def before_eval(self, model) -> None:
        model.set_window(self.long_window)

    def before_step(self, step: int, model) -> dict:
        window = window_for_step(step, self.t, self.long_window)
        model.set_window(window)
        return {"window": window}


def step_hooks(cfg: Config) -> list:
    """What changes the model from step to step (before_eval(model), before_step(step, model) -> values logged
    with the step): the window schedule."""
    return [WindowSchedule(cfg.train, cfg.model.swa_window)] if cfg.train.window_schedule != "fixed" else []
