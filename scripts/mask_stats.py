"""Score accounting and receptive fields of a model config's attention layers (paper 004, Table 2 style).

    python -m scripts.mask_stats configs/quickstart.py --seq_len=1024 --attn_pattern=swa --swa_window=128
    python -m scripts.mask_stats configs/quickstart.py --seq_len=1024 --attn_pattern=block --json

Per layer and head: the attention scores the variant computes (branch form: every score of every
separately normalised branch) and its unique allowed edges (union form), with their ratios to full causal
attention and to SWA with the config's swa_window; then the scores its kernels evaluate (every tile of the
CPU's kernel, every block of FlexAttention's block mask on CUDA; --flex=False skips building those) over its
edges, so a rule whose cost does not follow its edges shows it (swa(256): 1.5x on both). Then the all-depth receptive field (004 Sec. 3.1): which
source positions can reach each target through the layer stack, residual connections included. Everything is
counted from the layers' own edge rules; nothing is hard-coded. Extra --key=value arguments override the
config as in train.py.
"""

import dataclasses
import json
import sys
from dataclasses import dataclass

import torch

if not __package__:  # run as a file, the project's modules cannot be imported: say how to run it
    sys.exit("run it from the repository root as a module: python -m scripts.mask_stats ...")

from attention.capabilities import EdgeCounts, Reachability, head_windows, write_back_coverage  # noqa: E402
from attention.edges import Causal, SlidingWindow  # noqa: E402
from attention.kernels import layer_scores  # noqa: E402
from config import (HELP_FLAGS, ConfigError, apply_args, dataclass_fields, exit_on_config_error, load_config,  # noqa: E402
                    config_files, print_help, split_args)
from model import GPT  # noqa: E402


def layer_stats(model, seq_len: int, swa_window: int, flex_model=None) -> list[dict]:
    full = Causal().count_edges(seq_len)
    swa = SlidingWindow(swa_window).count_edges(seq_len)
    rows = []
    for i, block in enumerate(model.blocks):
        mixer = block.mixer
        if not isinstance(mixer, EdgeCounts):  # recurrent mixers: a state, no attention edges
            rows.append({"layer": i, "mixer": type(mixer).__name__, "heads": None})
            continue
        heads = mixer.edge_counts(seq_len)
        windows = head_windows(mixer)
        computed = sum(c for c, _ in heads) / len(heads)
        edges = sum(e for _, e in heads) / len(heads)
        kernel, kernel_computed = layer_scores(mixer, seq_len)
        flex_kernel, flex_computed = layer_scores(flex_model.blocks[i].mixer, seq_len) if flex_model else ("", None)
        rows.append({
            # what the kernels evaluate, tiles and blocks whole, against the edges the rule allows
            "kernel": kernel, "kernel_scores_per_head": kernel_computed,
            "kernel_vs_edges": kernel_computed / edges if kernel_computed is not None and edges else None,
            "flex_kernel": flex_kernel, "flex_scores_per_head": flex_computed,
            "flex_vs_edges": flex_computed / edges if flex_computed is not None and edges else None,
            "layer": i, "mixer": type(mixer).__name__, "rule": repr(mixer.edge_rule()) if hasattr(mixer, "edge_rule")
            else None,
            "heads": [{"head": h, "scores": c, "edges": e} for h, (c, e) in enumerate(heads)],
            "scores_per_head": computed, "edges_per_head": edges,
            "scores_vs_full": computed / full, "scores_vs_swa": computed / swa,
            "edges_vs_full": edges / full, "edges_vs_swa": edges / swa,
            "head_windows": windows, "describe": mixer.describe(),
            # positions given a bridge output (branch variants of paper 004)
            "write_back": write_back_coverage(mixer, seq_len),
        })
    return rows


def receptive_field(model, seq_len: int) -> list[dict]:
    """Reachability through the stack: reach[q, s] after layer l, with the residual path (identity) kept."""
    eye = torch.eye(seq_len, dtype=torch.bool)
    reach = eye.clone()
    causal_pairs = seq_len * (seq_len + 1) / 2
    rows = []
    for i, block in enumerate(model.blocks):
        if isinstance(block.mixer, Reachability):
            step = block.mixer.edge_mask(seq_len) | eye
        else:  # a mixer that does not say: every causal pair, and the row says so
            step = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
        reach = (step.float() @ reach.float()) > 0
        sources = reach.sum(1)  # per target position
        rows.append({"layer": i, "mean_sources": sources.float().mean().item(),
                     "sources_of_last": int(sources[-1]), "min_sources_last_quarter":
                     int(sources[3 * seq_len // 4:].min()),
                     "coverage": reach.sum().item() / causal_pairs,
                     "targets_fully_covered": (sources == torch.arange(1, seq_len + 1)).float().mean().item(),
                     "edges_assumed_causal": not isinstance(block.mixer, Reachability)})
    return rows


@dataclass
class MaskStatsConfig:
    config: str = ""  # a model config file (configs/*.py; or given as a positional argument)
    seq_len: int = 0  # the sequence length counted (required)
    json: bool = False  # print JSON instead of tables
    flex: bool = True  # also count the scores of FlexAttention's block masks (CUDA's kernel; built on the CPU)
    receptive_field: str = "auto"  # auto | yes | no: the all-depth receptive field (auto: seq_len <= 2048; O(L n^3))


def parse(argv) -> tuple[MaskStatsConfig, list[str]]:
    """The tool's options, and the rest: config files and train.py's --key=value overrides of the model."""
    fields = dataclass_fields(MaskStatsConfig)
    if any(arg in HELP_FLAGS for arg in argv):
        print_help(MaskStatsConfig(), fields, more="Any other --key=value is a model setting, as in train.py "
                                                   "(python train.py --help lists them).")
        raise SystemExit(0)
    own, overrides = split_args(argv, fields)
    args = MaskStatsConfig()
    apply_args(args, own, fields)
    if args.seq_len < 1:
        raise ConfigError("--seq_len=N is required (N >= 1)")
    if args.receptive_field not in ("auto", "yes", "no"):
        raise ConfigError(f"receptive_field={args.receptive_field!r}: expected auto, yes or no")
    files = config_files(overrides)
    if not args.config and not files:
        raise ConfigError("no model config: python -m scripts.mask_stats CONFIG.py --seq_len=N [--key=value ...]")
    if not args.config:  # the first config file given positionally is the one reported
        args.config = files[0]
        overrides.remove(files[0])
    return args, overrides


def main(argv):
    args, overrides = exit_on_config_error(parse, argv)
    cfg = exit_on_config_error(load_config, [args.config, *overrides])
    m = cfg.model
    m.vocab_size = m.vocab_size or 64  # irrelevant to the attention edges
    with torch.device("meta"):  # rules and counts need no weights
        model = GPT(m)
        flex_model = GPT(dataclasses.replace(m, attn_backend="flex")) if args.flex else None  # CUDA's kernel
    layers = layer_stats(model, args.seq_len, m.swa_window, flex_model)
    want_rf = args.receptive_field == "yes" or (args.receptive_field == "auto" and args.seq_len <= 2048)
    rf = receptive_field(model, args.seq_len) if want_rf else None
    reference = {"full": Causal().count_edges(args.seq_len), "swa": SlidingWindow(m.swa_window).count_edges(args.seq_len)}

    windowed = [row for row in layers if row.get("head_windows")]
    window_sum = sum(sum(row["head_windows"]) for row in windowed)
    swa_sum = m.swa_window * m.n_head * len(windowed)
    # paper 002's relative cost: the sum of the window sizes over all heads and layers (Eq. 8-10)
    summed = {"windowed_layers": len(windowed), "sum": window_sum, "swa_sum": swa_sum,
              "swa_over_this": swa_sum / window_sum if window_sum else None}
    if args.json:
        print(json.dumps({"config": args.config, "overrides": overrides, "seq_len": args.seq_len,
                          "attn_pattern": m.attn_pattern, "reference_per_head": reference,
                          "layers": layers, "summed_windows": summed, "receptive_field": rf}, indent=2))
        return
    n = args.seq_len
    print(f"{args.config} {' '.join(overrides)}: seq_len {n}, {m.n_layer} layers x {m.n_head} heads, "
          f"pattern {m.attn_pattern!r}")
    print(f"reference per head: full causal {reference['full']:,} scores; swa({m.swa_window}) {reference['swa']:,}")
    print(f"{'layer':>5} {'mixer':<24} {'scores/head':>12} {'edges/head':>12} {'vs full':>8} {'vs swa':>8} "
          f"{'computed by the kernels / edges':>34}")
    ratio = lambda kernel, value: f"{kernel} {value:.2f}x" if value is not None else kernel  # noqa: E731
    for row in layers:
        if row["heads"] is None:
            print(f"{row['layer']:>5} {row['mixer']:<24} (no attention edges)")
            continue
        per_head = {h["scores"] for h in row["heads"]}
        scores = f"{row['scores_per_head']:,.0f}" if len(per_head) == 1 else f"{row['scores_per_head']:,.1f}*"
        computed = ratio(row["kernel"], row["kernel_vs_edges"]) + (
            f", {ratio(row['flex_kernel'], row['flex_vs_edges'])}" if row["flex_kernel"] and row["flex_vs_edges"] else "")
        print(f"{row['layer']:>5} {row['mixer']:<24} {scores:>12} {row['edges_per_head']:>12,.0f} "
              f"{row['scores_vs_full']:>8.4f} {row['scores_vs_swa']:>8.4f} {computed:>34}")
        if len(per_head) > 1:
            print("      * mean over heads; per head: " + ", ".join(f"{h['scores']:,}" for h in row["heads"]))
        if row["describe"]:
            print(f"      {row['describe']}")
        if row["write_back"] is not None:
            print(f"      bridge write-back coverage {row['write_back']:,} / {n:,} positions")
    if windowed:
        print(f"summed window sizes over {len(windowed)} windowed layers x {m.n_head} heads: {window_sum:,} "
              f"(SWA with w={m.swa_window}: {swa_sum:,}; relative cost SWA / this = {summed['swa_over_this']:.4f})")
    if rf:
        print(f"\nall-depth receptive field (sources reachable per target, residuals included; n = {n}):")
        print(f"{'layer':>5} {'mean':>10} {'last target':>12} {'coverage':>9} {'fully covered targets':>22}")
        for row in rf:
            print(f"{row['layer']:>5} {row['mean_sources']:>10.1f} {row['sources_of_last']:>12,} "
                  f"{row['coverage']:>9.4f} {row['targets_fully_covered']:>22.4f}"
                  + ("  (edges not declared: every causal pair assumed)" if row["edges_assumed_causal"] else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
