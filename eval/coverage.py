"""Coverage theory of paper 004 (Sec. 3.5-3.9), computed from the variants' edge rules.

A target t = j b + r (phase r = t mod b) and a source u = t - d (offset d). The coverage C_M(d, r) says whether
the source can reach the target: for fixed blocks through any number of layers (Proposition 1, all-depth),
for the others through one layer's direct edges (Sec. 3.6; stacked layers reach further). Computed here from
the rules of attention/edges.py and attention/bridge.py (the ones every kernel uses) and compared with the
paper's closed forms:

    C_Block(d, r) = 1{d <= r}                                          (Eq. 18)
    C_SWA(d, r)   = 1{0 <= d < w}                                      (Eq. 22)
    C_PBB(d, r)   = 1{d <= r} or 1{r < h, r < d <= r + h},  h = w/2    (Eq. 23; centered bridge: the same)
    C_SE(d, r)    = 1{d <= r} or 1{r < e, r < d <= r + b}              (Eq. 24)

and Proposition 2 (a centered bridge's pre-boundary write-back adds no source beyond the block's) and
Proposition 4 (SWA's and SE-Bridge's coverage sets are not nested) are checked by enumeration.

    python -m eval.coverage --block 128 --width 128 --extension 64 [--json out/coverage.json]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from attention.bridge import BoundaryWindows
from attention.edges import EdgeRule, FixedBlock
from attention.registry import build_mixer
from config import ConfigError, ModelConfig, apply_args, dataclass_fields, exit_on_config_error
from common.outputs import write_json

VARIANTS = ("block", "swa", "bridge", "pbb", "se_bridge")


def rules(block: int, width: int, extension: int, context: int) -> dict[str, EdgeRule]:
    """Each variant's edges in one layer, as its mixer builds them (Mixer.edge_rule: bridges in their union
    form, every edge either path has)."""
    settings = {"block_len": block, "swa_window": width, "bridge_width": width, "bridge_extension": extension}
    out = {}
    for name in VARIANTS:
        config = ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=context, attn_pattern=name, **settings)
        with torch.device("meta"):
            out[name] = build_mixer(config, 0).edge_rule()
    return out


def reference_targets(block: int, max_distance: int) -> torch.Tensor:
    """Targets t = j b + r, r = 0 .. b-1, in a block j far enough in that every source t - d >= 0."""
    j = -(-max_distance // block) + 1
    return j * block + torch.arange(block)


def direct_coverage(rule: EdgeRule, block: int, max_distance: int) -> torch.Tensor:
    """C[d, r] (bool, (max_distance + 1, block)): the one-layer edge t - d -> t for t of phase r."""
    t = reference_targets(block, max_distance)
    d = torch.arange(max_distance + 1)[:, None]
    return rule.allowed(t[None, :], t[None, :] - d)


def all_depth_coverage(rule: EdgeRule, block: int, max_distance: int, depth: int) -> torch.Tensor:
    """C[d, r] through `depth` layers of the rule, residual connections included (Eq. 1-2)."""
    t = reference_targets(block, max_distance)
    n = int(t[-1]) + 1
    pos = torch.arange(n)
    step = (rule.dense_mask(pos) | torch.eye(n, dtype=torch.bool)).float()
    reach = torch.eye(n)
    for _ in range(depth):
        reach = ((step @ reach) > 0).float()
    d = torch.arange(max_distance + 1)[:, None]
    return reach[t[None, :], t[None, :] - d].bool()


def closed_form(variant: str, block: int, width: int, extension: int, max_distance: int) -> torch.Tensor:
    """The paper's C(d, r) over d = 0 .. max_distance and r = 0 .. b-1 (Eq. 18, 22-24)."""
    d = torch.arange(max_distance + 1)[:, None]
    r = torch.arange(block)[None, :]
    within_block = d <= r
    if variant == "block":
        return within_block.expand(-1, block)
    if variant == "swa":
        return (d < width).expand(-1, block)
    if variant in ("bridge", "pbb"):
        h = width // 2
        return within_block | ((r < h) & (r < d) & (d <= r + h))
    if variant == "se_bridge":
        return within_block | ((r < extension) & (r < d) & (d <= r + block))
    raise ValueError(f"unknown variant {variant!r}: expected one of {', '.join(VARIANTS)}")


def pre_boundary_write_back_adds_no_source(block: int, width: int, context: int) -> bool:
    """Proposition 2: for a centered bridge, every source a pre-boundary target t in [p - w/2, p) reads in the
    bridge window is already one of its block sources."""
    n = context
    pos = torch.arange(n)
    bridge = BoundaryWindows("bridge", block, width, context).dense_mask(pos)
    fixed = FixedBlock(block).dense_mask(pos)
    pre_boundary = (pos % block) >= block - width // 2
    return bool(pre_boundary.any() and not (bridge[pre_boundary] & ~fixed[pre_boundary]).any())


def not_nested(a: torch.Tensor, b: torch.Tensor) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """Witnesses (d, r) in a but not b, and in b but not a (None where there is none)."""
    only_a, only_b = (a & ~b).nonzero(), (b & ~a).nonzero()
    first = lambda cells: tuple(int(x) for x in cells[0]) if len(cells) else None
    return first(only_a), first(only_b)


def report(block: int, width: int, extension: int, depth: int = 3) -> dict:
    max_distance = 2 * block + extension
    context = (-(-max_distance // block) + 2) * block
    coverage, checks = {}, {}
    for variant, rule in rules(block, width, extension, context).items():
        measured = (all_depth_coverage(rule, block, max_distance, depth) if variant == "block"
                    else direct_coverage(rule, block, max_distance))
        expected = closed_form(variant, block, width, extension, max_distance)
        coverage[variant] = measured
        checks[variant] = {"equals_closed_form": bool(torch.equal(measured, expected)),
                           "covered_cells": int(measured.sum()),
                           "phases_covered_by_distance": measured.sum(1).tolist()}
    swa_only, se_only = not_nested(coverage["swa"], coverage["se_bridge"])
    pbb_in_se = bool(not (coverage["pbb"] & ~coverage["se_bridge"]).any())
    return {
        "block": block, "width": width, "extension": extension, "max_distance": max_distance,
        "block_depth_checked": depth, "variants": checks,
        "proposition_2_pre_boundary_write_back_adds_no_source": pre_boundary_write_back_adds_no_source(
            block, width, context),
        "proposition_4_swa_se_not_nested": swa_only is not None and se_only is not None,
        "swa_not_se_witness_d_r": swa_only, "se_not_swa_witness_d_r": se_only,
        "pbb_coverage_inside_se": pbb_in_se,
    }


@dataclass
class CoverageConfig:
    block: int = 128  # b: the block length
    width: int = 128  # w: swa window and bridge / pbb width
    extension: int = 64  # e: se_bridge source extension
    depth: int = 3  # layers for block's all-depth coverage
    json: str = ""  # also write the report here


def parse(argv) -> CoverageConfig:
    args = CoverageConfig()
    apply_args(args, argv, dataclass_fields(CoverageConfig))
    if min(args.block, args.width, args.depth) < 1 or args.extension < 0:
        raise ConfigError("need block, width and depth >= 1 and extension >= 0")
    return args


def main(argv):
    args = exit_on_config_error(parse, argv)
    out = report(args.block, args.width, args.extension, args.depth)
    print(f"coverage C(d, r) at b={args.block}, w={args.width} (h={args.width // 2}), e={args.extension}, "
          f"d = 0..{out['max_distance']} (block: through {args.depth} layers; others: one layer's edges)")
    print(f"{'variant':<10} {'cells':>7} {'= closed form':>14}  phases covered at d = 1, h, h+1, b-1, b, b+e-1, b+e")
    h, b, e = args.width // 2, args.block, args.extension
    for variant, check in out["variants"].items():
        phases = check["phases_covered_by_distance"]
        at = [phases[d] if d < len(phases) else 0 for d in (1, h, h + 1, b - 1, b, b + e - 1, b + e)]
        print(f"{variant:<10} {check['covered_cells']:>7,} {str(check['equals_closed_form']):>14}  {at}")
    print(f"Proposition 2 (pre-boundary write-back adds no source): {out['proposition_2_pre_boundary_write_back_adds_no_source']}")
    print(f"Proposition 4 (SWA and SE-Bridge not nested): {out['proposition_4_swa_se_not_nested']} "
          f"(SWA only at (d, r) = {out['swa_not_se_witness_d_r']}, SE only at {out['se_not_swa_witness_d_r']})")
    print(f"PBB's coverage inside SE-Bridge's (e = h): {out['pbb_coverage_inside_se']}")
    if args.json:
        write_json(out, args.json)
    ok = all(c["equals_closed_form"] for c in out["variants"].values())
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
