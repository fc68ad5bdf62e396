"""Paper 004's comparison: the six attention families x seeds, trained, diagnosed, and tabulated as the paper does.

    python -m scripts.bridges.sweep --scale=cpu --seeds=1337                       # minutes per model on a CPU
    python -m scripts.bridges.sweep --scale=cpu_recall --seeds=1337                # retrieval, answer-only training
    python -m scripts.bridges.sweep --scale=124m --seeds=1337,2025,3047            # App. D's setting, on GPUs
    python -m scripts.bridges.sweep --scale=cpu --tables_only                      # re-tabulate finished runs

Trains configs/bridges/bridges_cpu_<family>.py (or configs/bridges/owt_124m_<family>.py) for every seed with scripts/sweep.py
(finished runs are kept, interrupted ones resumed), evaluates each with `python -m eval --tasks=ppl,diagnostics`,
then writes OUT/tables.md and OUT/tables.json:
    Table 3   per family, means over seeds: best-validation perplexity and the diagnostic accuracies
    Table 4   bridge-window recovery: gain over Block (Eq. 42), share of the SWA-over-Block gap recovered
              (Eq. 43), gain per 100 write-back positions
    Tables 6-8  the same per seed: perplexity and needle, the boundary-local probes, the semantic probes
    Table 9   paired comparisons pooled over seeds (exact McNemar, paired bootstrap CI, A-only / B-only wins)
    Fig. 5    prompt-token NLL improvement over Block in 16-token bins, inside and outside the bridge write-back
and the figures as PNGs in OUT: fig2_needle_by_distance.png (mean over seeds, shaded one standard deviation),
fig3_semantic_by_distance.png, fig4_boundary_offset.png (accuracy by offset from the boundary) and
fig5_prompt_nll.png (16-token bins of NLL improvement over Block, needle and boundary-focused prompts, block
boundaries dashed).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as a file, the project's modules cannot be imported: say how to run it
    sys.exit("run it from the repository root as a module: python -m scripts.bridges.sweep ...")

from config import ConfigError, apply_args, dataclass_fields, exit_on_config_error  # noqa: E402
from eval.bridge_tables import FAMILIES, figures, load_run, tables  # noqa: E402
from common.outputs import atomic_write, write_json  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# cpu: language modelling on the facts corpus; cpu_recall: answer-only training on recall_near, where models
# this small learn to retrieve (its diagnostics: the geometry probes, in the recall format)
CONFIGS = {"cpu": "configs/bridges/bridges_cpu_{}.py", "cpu_recall": "configs/bridges/bridges_cpu_recall_{}.py",
           "124m": "configs/bridges/owt_124m_{}.py"}
# what every run is evaluated with (python -m eval arguments; diagnostics are required)
# and the scale's geometry (b, h = b / 2) given to every family alike: full and swa runs read no block_len
EVAL = {"cpu": "--tasks=ppl,diagnostics --diag_samples=25 --diag_block=64 --diag_half=32 --progress=False",
        # answers only (no text perplexity); needles at the trained distances: further back, a statement is
        # always an earlier document's, which a model trained on this corpus rightly ignores
        "cpu_recall": "--tasks=diagnostics --diag_samples=200 --diag_distances=16,32,48,64,80,96 --diag_block=64 "
                      "--diag_half=32 --progress=False",
        # the paper's prompts per probe and seed
        "124m": "--tasks=ppl,diagnostics --diag_block=128 --diag_half=64 --progress=False"}


def run_dir(out: Path, config: str, seed: int) -> Path:
    return out / f"{Path(config).stem}_s{seed}"


@dataclass
class BridgeSweepConfig:
    scale: str = "cpu"  # cpu, cpu_recall or 124m: which configs (configs/bridges/)
    seeds: str = "1337"  # comma-separated (the paper: 1337,2025,3047)
    families: str = ",".join(FAMILIES)  # comma-separated attention families
    out: str = ""  # the sweep's folder (empty: out/sweeps/bridges_<scale>)
    eval: str = ""  # arguments of python -m eval for every run (diagnostics are required; empty: the scale's)
    extra: str = ""  # --key=value overrides added to every training run
    tables_only: bool = False  # tabulate the finished runs in --out, train nothing


def parse(argv) -> BridgeSweepConfig:
    args = BridgeSweepConfig()
    apply_args(args, argv, dataclass_fields(BridgeSweepConfig))
    if args.scale not in CONFIGS:
        raise ConfigError(f"scale={args.scale!r}: expected one of {', '.join(sorted(CONFIGS))}")
    unknown = set(args.families.split(",")) - set(FAMILIES)
    if unknown:
        raise ConfigError(f"unknown families {', '.join(sorted(unknown))}: expected some of {', '.join(FAMILIES)}")
    if not all(s.strip().lstrip("-").isdigit() for s in args.seeds.split(",")):
        raise ConfigError(f"seeds={args.seeds!r}: comma-separated integers")
    return args


def main(argv):
    args = exit_on_config_error(parse, argv)
    families = args.families.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out or f"out/sweeps/bridges_{args.scale}")
    configs = [CONFIGS[args.scale].format(f) for f in families]
    if not args.tables_only:
        command = [sys.executable, "-m", "scripts.sweep", *configs, f"--out={out}",
                   f"--seeds={args.seeds}", f"--eval={args.eval or EVAL[args.scale]}"] + ([f"--extra={args.extra}"] if args.extra else [])
        print("+ " + shlex.join(command), flush=True)
        subprocess.run(command, check=True, cwd=REPO)
    runs = {}
    for family, config in zip(families, configs):
        for seed in seeds:
            path = run_dir(out, config, seed)
            if (path / "eval" / "diagnostics.json").exists():
                runs.setdefault(family, {})[seed] = load_run(path)
            else:
                print(f"missing: {path} (not trained or not evaluated with diagnostics)", file=sys.stderr)
    if not runs:
        sys.exit(f"no finished runs in {out}")
    text, data = tables(runs)
    command = "python -m scripts.bridges.sweep " + " ".join(shlex.quote(a) for a in argv)
    atomic_write(out / "tables.md", lambda f: f.write(f"# Paper 004 comparison\n\nCommand: `{command}`\n\n{text}".encode()))
    write_json({"command": command, **data}, out / "tables.json")
    pngs = figures(runs, out)
    print(text)
    print(f"wrote {out / 'tables.md'}, {out / 'tables.json'}" + "".join(f", {p.name}" for p in pngs))


if __name__ == "__main__":
    main(sys.argv[1:])
