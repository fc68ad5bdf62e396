"""Context parallelism's shard of a sequence, and the two exchanges its layers make, counted in bytes.

A sequence of n tokens is cut into P contiguous shards, one per process of a context-parallel group; process r
holds positions [r n / P, (r + 1) n / P). A layer exchanges only what its rule reaches on other processes:

    gather_range   the positions [lo, hi) a process's queries need (a window's halo, the keys a rule's
                   key_ranges name, a short convolution's last inputs), each from the process that owns it, by
                   point-to-point sends; in backward their gradients go back to their owners. Every process
                   knows what every other one needs (`needs(rank)` is the same function everywhere: a rule's
                   key_ranges, a convolution's width), so no request is ever sent.
    all_gather     one small tensor per process (a recurrence's summary of its shard), to every process; in
                   backward each gets the sum of every process's gradient of its own.

Both count what this process sends and receives (Traffic), forward and backward apart, per label: what the
benchmarks and the byte bounds of docs/context_parallel.md read.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist


@dataclass
class Traffic:
    """Bytes this process sent and received: {(label, "forward" | "backward"): [sent, received]}, and how many
    exchanges each (one per layer and forward or backward): {(label, direction): count}."""

    bytes: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    calls: dict = field(default_factory=lambda: defaultdict(int))

    def add(self, label: str, direction: str, sent: int, received: int) -> None:
        entry = self.bytes[(label, direction)]
        entry[0] += sent
        entry[1] += received
        self.calls[(label, direction)] += 1

    def clear(self) -> None:
        self.bytes.clear()
        self.calls.clear()


@dataclass(eq=False)
class Shard:
    """This process's shard of a sequence of n tokens cut into `size` equal contiguous parts, and the group that
    holds the others. docs (B, n): where each token of the whole sequence begins its document (the model sets it
    for each forward; None without document_mask)."""

    group: object  # a torch.distributed ProcessGroup, None for the default group
    rank: int
    size: int
    n: int
    docs: torch.Tensor | None = None
    traffic: Traffic = field(default_factory=Traffic)

    def __post_init__(self):
        if self.n % self.size:
            raise ValueError(f"a sequence of {self.n} tokens cannot be cut into {self.size} equal shards: use a "
                             f"block_size divisible by context_parallel={self.size}")

    @property
    def length(self) -> int:
        return self.n // self.size

    def bounds(self, rank: int | None = None) -> tuple[int, int]:
        r = self.rank if rank is None else rank
        return r * self.length, (r + 1) * self.length

    @property
    def start(self) -> int:
        return self.bounds()[0]

    @property
    def end(self) -> int:
        return self.bounds()[1]

    def with_docs(self, docs) -> "Shard":
        return Shard(self.group, self.rank, self.size, self.n, docs, self.traffic)

    def peer(self, rank: int) -> int:
        """The global rank of the group's rank-th process."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    @torch.compiler.disable  # point-to-point sends: compiled blocks break around the exchange
    def gather_range(self, x: torch.Tensor, needs: Callable[[int], tuple[int, int]], dim: int,
                     label: str = "") -> torch.Tensor:
        """x (this shard's positions along dim) widened to [lo, hi) = needs(this rank): positions of other shards
        received from their owners, positions outside the sequence zero. needs(r) is what rank r needs, for every
        r: every process calls this with the same function."""
        return _GatherRange.apply(x, self, needs, dim, label)

    @torch.compiler.disable
    def all_gather(self, x: torch.Tensor, label: str = "") -> torch.Tensor:
        """Every process's x, stacked (size, *x.shape), differentiable."""
        return _AllGather.apply(x, self, label)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def received_positions(shard: Shard, needs) -> int:
    """How many positions this process receives in a gather_range with needs (what the exchange's plan gives:
    benchmarks project bytes from it without running the exchange)."""
    return sum(b - a for _, a, b in _plan(shard, needs)[1])


def _plan(shard: Shard, needs) -> tuple[list, list]:
    """(sends, receives): [(peer rank, lo, hi)] of the positions this process sends to each other process (what
    they need of its shard) and receives from each (what it needs of theirs)."""
    mine = shard.bounds()
    sends, receives = [], []
    for r in range(shard.size):
        if r == shard.rank:
            continue
        out = _overlap(needs(r), mine)
        if out:
            sends.append((r, *out))
        into = _overlap(needs(shard.rank), shard.bounds(r))
        if into:
            receives.append((r, *into))
    return sends, receives


def _exchange(shard: Shard, outgoing: list, incoming: list) -> None:
    """Point-to-point: outgoing [(peer, tensor)] sent, incoming [(peer, buffer)] filled."""
    ops = [dist.P2POp(dist.isend, t.contiguous(), shard.peer(r), shard.group) for r, t in outgoing]
    ops += [dist.P2POp(dist.irecv, t, shard.peer(r), shard.group) for r, t in incoming]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _GatherRange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard: Shard, needs, dim: int, label: str):
        lo, hi = needs(shard.rank)
        s, e = shard.bounds()
        sends, receives = _plan(shard, needs)
        shape = list(x.shape)
        shape[dim] = hi - lo
        out = x.new_zeros(shape)
        outgoing = [(r, x.narrow(dim, a - s, b - a)) for r, a, b in sends]
        incoming = [(r, x.new_empty(shape[:dim] + [b - a] + shape[dim + 1:])) for r, a, b in receives]
        _exchange(shard, outgoing, incoming)
        own = _overlap((lo, hi), (s, e))
        if own:
            out.narrow(dim, own[0] - lo, own[1] - own[0]).copy_(x.narrow(dim, own[0] - s, own[1] - own[0]))
        for (r, a, b), (_, buffer) in zip(receives, incoming):
            out.narrow(dim, a - lo, b - a).copy_(buffer)
        shard.traffic.add(label, "forward", _nbytes(t for _, t in outgoing), _nbytes(t for _, t in incoming))
        ctx.shard, ctx.dim, ctx.lo, ctx.own, ctx.sends, ctx.receives = shard, dim, lo, own, sends, receives
        ctx.x_shape, ctx.label = x.shape, label
        return out

    @staticmethod
    def backward(ctx, grad):
        shard, dim, lo = ctx.shard, ctx.dim, ctx.lo
        s, _ = shard.bounds()
        grad_x = grad.new_zeros(ctx.x_shape)
        if ctx.own:
            a, b = ctx.own
            grad_x.narrow(dim, a - s, b - a).add_(grad.narrow(dim, a - lo, b - a))
        # what this process received goes back to its owner as a gradient; what it sent comes back as one
        outgoing = [(r, grad.narrow(dim, a - lo, b - a)) for r, a, b in ctx.receives]
        shape = list(ctx.x_shape)
        incoming = [(r, grad.new_empty(shape[:dim] + [b - a] + shape[dim + 1:])) for r, a, b in ctx.sends]
        _exchange(shard, outgoing, incoming)
        for (r, a, b), (_, buffer) in zip(ctx.sends, incoming):
            grad_x.narrow(dim, a - s, b - a).add_(buffer)
        shard.traffic.add(ctx.label, "backward",
                          _nbytes(t for _, t in outgoing), _nbytes(t for _, t in incoming))
        return grad_x, None, None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard: Shard, label: str):
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(shard.size)]
        dist.all_gather(parts, x, group=shard.group)
        shard.traffic.add(label, "forward", _nbytes([x]) * (shard.size - 1), _nbytes([x]) * (shard.size - 1))
        ctx.shard, ctx.label = shard, label
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        shard = ctx.shard
        grad = grad.contiguous()
        # every process's gradient of every part, summed: each keeps its own part's (gloo has no reduce-scatter)
        dist.all_reduce(grad, group=shard.group)
        shard.traffic.add(ctx.label, "backward", _nbytes([grad[0]]) * (shard.size - 1),
                          _nbytes([grad[0]]) * (shard.size - 1))
        return grad[shard.rank], None, None
