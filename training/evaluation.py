"""The validation loss of a training run: a fixed budget of validation windows (eval_budget), split across
ranks, drawn from an RNG of its own so that evaluating leaves training's draws as they were."""

from contextlib import contextmanager

import torch
import torch.distributed as dist

from config import Config
from data.loader import WindowSampler


def eval_budget(cfg: Config) -> dict:
    """What a validation loss is measured over: the same eval_iters batches of batch_size windows of block_size
    tokens (losses over other budgets are other numbers, not comparable to the digit)."""
    return {"eval_iters": cfg.eval.eval_iters, "batch_size": cfg.train.batch_size, "block_size": cfg.model.block_size}


def describe_budget(budget: dict) -> str:
    return f"eval_iters={budget['eval_iters']} x batch_size={budget['batch_size']} x block_size={budget['block_size']}"


@contextmanager
def isolated_rng(seed: int, device):
    """Evaluation draws (sa's permutations) from its own seeded RNG: the training RNG stream is left as it
    was, so a resumed run (which re-evaluates at its first step) draws what the uninterrupted one drew, and
    every evaluation of a run uses the same draws."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


@torch.no_grad()  # no autograd graph: evaluation holds one batch's activations at a time
def evaluate(model, val_data: WindowSampler, eval_iters: int, rank: int, world_size: int, autocast, device,
             loss_chunk: int = 0, sharded: bool = False, shard=None):
    """Mean validation loss over a fixed set of eval_iters batches, split across ranks and averaged. A sharded
    model gathers each block's weights in every forward, a collective: every rank then runs the same number
    of forwards, those past eval_iters uncounted. Under context parallelism (shard) rank and world_size count
    data-parallel replicas, whose processes each score the same batches' shards."""
    model.eval()
    total = torch.zeros(2, device=device, dtype=torch.float64)
    rounds = -(-eval_iters // world_size) if sharded else len(range(rank, eval_iters, world_size))
    for index in range(rank, rank + rounds * world_size, world_size):
        x, y = val_data.batch(0, min(index, eval_iters - 1))
        with autocast:
            _, loss = model(x, y, loss_chunk=loss_chunk, shard=shard)
        if index < eval_iters:
            total[0] += loss.detach().double()
            total[1] += 1
    if world_size > 1:  # over every process: the P processes of a sequence count its batches alike
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()
