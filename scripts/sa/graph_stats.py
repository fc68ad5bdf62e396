"""Stochastic attention's graph statistics (paper 000, App. A.1-A.2 and Fig. 2 left), from its edge rule.

    python -m scripts.sa.graph_stats                                   # n=2048, w=32, as in Fig. 2 (left)
    python -m scripts.sa.graph_stats --n 4096 --window 256 --samples 20000 --max_depth 12 --plot out/sa_rf.png

1. Connection probability (App. A.1): for a uniform permutation and a uniform pair i != j, how often j lies
   in i's window. Estimated from `samples` permutations (each scoring `pairs` random pairs; the standard
   error is taken over permutations) and compared with the paper's (w-1)/(n-1), with the exact value for the
   window's slot count m = 2 floor((w-1)/2) + 1 (m = w for odd w, w - 1 for even w), and, with causality in
   original positions, with half of it.
2. Receptive field through depth (App. A.2): the share of the sequence a token can reach through l layers,
   each with a fresh permutation, for SA and for SWA with the same window: non-causal (the paper's setting:
   SA's circular window vs the symmetric window |i - j| < w/2) and causal (the last token, whose causal
   sources are the whole sequence). SA covers everything in about log_w n layers, SWA in about n / w.
Every edge comes from attention/stochastic.py (in_circular_window, stochastic_window_edges), nothing else.
"""

import json
import math
import sys
from dataclasses import dataclass

import torch

if not __package__:  # run as a file, the project's modules cannot be imported: say how to run it
    sys.exit("run it from the repository root as a module: python -m scripts.sa.graph_stats ...")

from attention.edges import window_edges  # noqa: E402
from attention.stochastic import (in_circular_window, inverse_permutation, stochastic_halo,  # noqa: E402
                                  stochastic_window_edges)
from config import ConfigError, apply_args, dataclass_fields, exit_on_config_error  # noqa: E402
from common.outputs import save_figure  # noqa: E402


def connection_probability(n: int, window: int, samples: int, pairs: int = 256, causal: bool = False,
                           seed: int = 0) -> dict:
    """Estimated Pr[j in the window of i] over `samples` permutations x `pairs` uniform pairs i != j."""
    g = torch.Generator().manual_seed(seed)
    per_permutation = torch.empty(samples, dtype=torch.float64)
    for s in range(samples):
        slot_of = inverse_permutation(torch.randperm(n, generator=g))
        i = torch.randint(n, (pairs,), generator=g)
        j = (i + torch.randint(1, n, (pairs,), generator=g)) % n  # uniform over the other n - 1 tokens
        edge = stochastic_window_edges(slot_of[i], slot_of[j], i, j, window, n) if causal \
            else in_circular_window(slot_of[i], slot_of[j], window, n)
        per_permutation[s] = edge.double().mean()
    estimate = per_permutation.mean().item()
    stderr = per_permutation.std().item() / math.sqrt(samples)
    slots = min(2 * stochastic_halo(window) + 1, n)
    scale = 0.5 if causal else 1.0  # a uniform ordered pair is causal (j < i) with probability 1/2
    paper, exact = scale * (window - 1) / (n - 1), scale * (slots - 1) / (n - 1)
    return {"n": n, "window": window, "causal": causal, "samples": samples, "pairs": pairs,
            "estimate": estimate, "stderr": stderr, "paper": paper, "exact": exact, "window_slots": slots,
            "z_paper": (estimate - paper) / stderr if stderr else None,
            "z_exact": (estimate - exact) / stderr if stderr else None}


def _layer_edges(kind: str, n: int, window: int, causal: bool, g: torch.Generator) -> torch.Tensor:
    """(n, n) boolean: edge[q, k] when query q attends key k in one layer (self included)."""
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    if kind == "swa":
        return window_edges(q, k, window) if causal else 2 * (q - k).abs() < window
    slot_of = inverse_permutation(torch.randperm(n, generator=g))
    if causal:
        return stochastic_window_edges(slot_of[q], slot_of[k], q, k, window, n)
    return in_circular_window(slot_of[q], slot_of[k], window, n)


def receptive_field(kind: str, n: int, window: int, max_depth: int, causal: bool, targets: int = 256,
                    seed: int = 0) -> list[float]:
    """Mean share of the sequence reachable from the targets after 1..max_depth layers (fresh permutations).

    Non-causal: `targets` evenly spaced tokens (all when 0). Causal: the last token only, whose sources are
    all n tokens. Stops early once everything is covered.
    """
    g = torch.Generator().manual_seed(seed)
    rows = torch.tensor([n - 1]) if causal else (
        torch.arange(n) if targets <= 0 or targets >= n else torch.linspace(0, n - 1, targets).long())
    reach = torch.zeros(len(rows), n)
    reach[torch.arange(len(rows)), rows] = 1  # a token reaches itself (the residual stream)
    coverage = []
    for _ in range(max_depth):
        edges = _layer_edges(kind, n, window, causal, g).float()
        reach = ((reach @ edges) > 0).float()  # sources of everything reached so far, one layer further down
        coverage.append(reach.mean().item())
        if coverage[-1] == 1.0:
            break
    return coverage


def depth_to_cover(coverage: list[float], level: float = 1.0):
    return next((depth for depth, c in enumerate(coverage, 1) if c >= level), None)


def plot(curves: dict, n: int, window: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, coverage in curves.items():
        ax.plot(range(1, len(coverage) + 1), coverage, marker="o" if "sa" in label.split()[0] else None,
                markersize=3, label=label)
    ax.axvline(math.log(n) / math.log(window), color="grey", ls=":", lw=1, label=f"log_w n = {math.log(n, window):.1f}")
    ax.set_xlabel("layers")
    ax.set_ylabel("receptive field coverage")
    ax.set_title(f"Receptive field through depth (n={n}, w={window})")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=150)


@dataclass
class StatsConfig:
    n: int = 2048  # sequence length
    window: int = 32
    samples: int = 4000  # permutations for the connection probability
    pairs: int = 256  # pairs scored per permutation
    max_depth: int = 0  # layers to follow (0: enough for swa)
    targets: int = 256  # non-causal receptive field: tokens averaged over (0: all)
    seed: int = 0
    plot: str = "out/sa_stats/receptive_field.png"  # figure path ('' for none)
    json: bool = False  # print JSON instead of the tables


def parse(argv) -> StatsConfig:
    args = StatsConfig()
    apply_args(args, argv, dataclass_fields(StatsConfig))
    if args.window < 2 or args.n < 2:
        raise ConfigError(f"n={args.n}, window={args.window}: both must be at least 2")
    if min(args.samples, args.pairs) < 1 or min(args.max_depth, args.targets) < 0:
        raise ConfigError("need samples >= 1, pairs >= 1, max_depth >= 0 and targets >= 0")
    return args


def main(argv):
    args = exit_on_config_error(parse, argv)
    n, w = args.n, args.window
    max_depth = args.max_depth or (2 * n) // max(1, w - 1) + 2  # a causal swa stack covers n in ~n/(w-1)

    probabilities = [connection_probability(n, w, args.samples, args.pairs, causal, args.seed)
                     for causal in (False, True)]
    curves = {}
    for kind in ("sa", "swa"):
        for causal in (False, True):
            label = f"{kind} {'causal, last token' if causal else 'non-causal'}"
            depth = max_depth if kind == "swa" else min(max_depth, 64)
            curves[label] = receptive_field(kind, n, w, depth, causal, args.targets, args.seed)
    summary = {label: {"full_coverage_at": depth_to_cover(c), "99%_at": depth_to_cover(c, 0.99)}
               for label, c in curves.items()}
    if args.plot:
        plot(curves, n, w, args.plot)
    if args.json:
        print(json.dumps({"connection_probability": probabilities, "receptive_field": curves,
                          "summary": summary, "plot": args.plot or None}, indent=2))
        return
    print(f"connection probability, n={n}, w={w} (window of {probabilities[0]['window_slots']} slots), "
          f"{args.samples} permutations x {args.pairs} pairs:")
    for p in probabilities:
        print(f"  {'causal    ' if p['causal'] else 'non-causal'} estimate {p['estimate']:.5f} +- {p['stderr']:.5f}"
              f"   paper {'(w-1)/(2(n-1))' if p['causal'] else '(w-1)/(n-1)'} = {p['paper']:.5f} "
              f"(z {p['z_paper']:+.2f})   exact {p['exact']:.5f} (z {p['z_exact']:+.2f})")
    print(f"\nreceptive field coverage by depth (log_w n = {math.log(n, w):.2f}, n/w = {n / w:.0f}):")
    labels = list(curves)
    print(f"{'layers':>6} " + " ".join(f"{label:>24}" for label in labels))
    for depth in range(max(len(c) for c in curves.values())):
        cells = [f"{curves[label][depth]:>24.4f}" if depth < len(curves[label]) else f"{'':>24}" for label in labels]
        if depth < 12 or depth % 8 == 7 or depth == max(len(c) for c in curves.values()) - 1:
            print(f"{depth + 1:>6} " + " ".join(cells))
    for label, s in summary.items():
        print(f"  {label:<24} 99% at {s['99%_at']} layers, full coverage at {s['full_coverage_at']} layers")
    if args.plot:
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main(sys.argv[1:])
