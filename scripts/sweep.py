"""Train a list of configs (x seeds), optionally evaluate them, and write one comparison table.

    python -m scripts.sweep configs/mswa/mswa_cpu_swa.py configs/mswa/mswa_cpu_mswa.py --out=out/sweeps/mswa_table2
    python -m scripts.sweep configs/mswa/mswa_cpu_*.py --seeds=1337,2025 --eval="--tasks=ppl --ppl_lengths=64,256"

Each run goes to OUT/<config name>_s<seed>; a run whose ckpt_last.pt (or sharded ckpt_last/) already reached max_iters is kept, one
with a checkpoint short of it is resumed, and one killed before its first checkpoint starts again (its partial
folder moved aside to <name>.replaced-TIME), so an interrupted sweep picks up where it stopped. The table (scripts/compare.py) and the exact command of the
sweep are written to OUT/results.md.
"""

import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, the project's modules cannot be imported: say how to run it
    sys.exit("run it from the repository root as a module: python -m scripts.sweep ...")

from config import ConfigError, apply_args, dataclass_fields, exit_on_config_error  # noqa: E402
from common.run_folder import holds_run, read_metrics  # noqa: E402


def has_last_checkpoint(run_dir: Path) -> bool:
    """ckpt_last.pt, or the folder ckpt_last/ of a sharded (parallelism=fsdp) run."""
    return (run_dir / "ckpt_last.pt").exists() or (run_dir / "ckpt_last" / "meta.pt").exists()


def finished(run_dir: Path) -> bool:
    config, metrics = run_dir / "config.json", run_dir / "metrics.jsonl"
    if not (config.exists() and metrics.exists() and has_last_checkpoint(run_dir)):
        return False
    max_iters = json.loads(config.read_text())["train"]["max_iters"]
    steps = [record["step"] for record in read_metrics(metrics)]  # a line torn by a kill is skipped
    return bool(steps) and max(steps) >= max_iters


@dataclass
class SweepConfig:
    configs: str = ""  # comma-separated config files to train (or given as positional arguments)
    out: str = "out/sweep"  # folder for the runs and results.md
    seeds: str = ""  # comma-separated seeds (empty: each config's own)
    extra: str = ""  # --key=value overrides added to every run
    eval: str = ""  # arguments of `python -m eval` run on every finished run


def parse(argv) -> SweepConfig:
    args = SweepConfig()
    apply_args(args, argv, dataclass_fields(SweepConfig), positional="configs")
    if not args.configs:
        raise ConfigError("no configs: python -m scripts.sweep CONFIG.py [CONFIG.py ...] [--out=...]")
    missing = [c for c in args.configs.split(",") if not (REPO / c).exists() and not Path(c).exists()]
    if missing:
        raise ConfigError(f"config file(s) not found: {', '.join(missing)}")
    if not all(s.strip().isdigit() for s in args.seeds.split(",") if s):
        raise ConfigError(f"seeds={args.seeds!r}: comma-separated integers")
    return args


def main(argv):
    args = exit_on_config_error(parse, argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [s for s in args.seeds.split(",") if s] or [None]
    runs = []
    for config in args.configs.split(","):
        for seed in seeds:
            name = Path(config).stem + (f"_s{seed}" if seed else "")
            run_dir = out / name
            runs.append(run_dir)
            if finished(run_dir):
                print(f"[sweep] {name}: already finished, kept")
                if args.eval and not (run_dir / "eval" / "summary.md").exists():  # interrupted before its eval
                    evaluate(run_dir, args.eval)
                continue
            # a run killed before its first checkpoint has nothing to resume: start it again, its partial log moved
            # aside whole (to NAME.replaced-TIME) rather than mixed with the new run's
            resume = ["--init_from=resume"] if has_last_checkpoint(run_dir) \
                else ["--replace_run=True"] if holds_run(run_dir) else []
            command = [sys.executable, "train.py", config, f"--out_dir={run_dir}", *shlex.split(args.extra),
                       *([f"--seed={seed}"] if seed else []), *resume]
            print(f"[sweep] {name}: {' '.join(command[1:])}", flush=True)
            started = time.time()
            result = subprocess.run(command, cwd=REPO)
            if result.returncode != 0:
                sys.exit(f"[sweep] {name} failed (exit {result.returncode}); rerun the sweep to resume it")
            print(f"[sweep] {name}: trained in {time.time() - started:.0f} s", flush=True)
            if args.eval:
                evaluate(run_dir, args.eval)
    table = subprocess.run([sys.executable, "-m", "scripts.compare", *map(str, runs), "--plot", "--out", str(out)],
                           cwd=REPO, capture_output=True, text=True)
    if table.returncode != 0:
        sys.exit(f"[sweep] compare.py failed:\n{table.stderr}")
    command = " ".join(["python", "-m", "scripts.sweep", *map(shlex.quote, argv)])
    (out / "results.md").write_text(f"# Sweep results\n\nCommand: `{command}`\n\n{table.stdout}")
    print(table.stdout)
    print(f"[sweep] wrote {out / 'results.md'} and plots in {out}")


def evaluate(run_dir: Path, eval_args: str):
    subprocess.run([sys.executable, "-m", "eval", f"--out_dir={run_dir}", "--progress=False",
                    *shlex.split(eval_args)], cwd=REPO, check=True)


if __name__ == "__main__":
    main(sys.argv[1:])
