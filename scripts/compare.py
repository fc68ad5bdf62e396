"""Compare training runs: one markdown table, seed groups, plots and paired statistics.

    python -m scripts.compare out/full_s1 out/full_s2 out/swa_s1                 # table of runs and seed groups
    python -m scripts.compare out/*/ --plot --out out/compare                    # + PNGs and compare.md
    python -m scripts.compare --paired out/full_s1 out/swa_s1 --task niah        # McNemar + bootstrap on examples
    python -m scripts.compare --paired out/full_s1 out/swa_s1 --task ppl --key nll   # per window: sign test
    python -m scripts.compare out/block_s* out/bridge_s* --position_gain block_s1    # NLL gain by position
    python -m scripts.compare --wandb ENTITY/PROJECT --runs full_s1,swa_s1       # the same table from wandb

A run folder is a train.py out_dir (config.json, metrics.jsonl, eval/<task>.json). The table shows the config
keys that differ across the runs, parameters, tokens seen, the best validation and final training losses and one
column per evaluation result; runs that differ only in `seed` form a group (mean +- std). What each column
means, and how local folders and wandb runs become the same record: eval/compare.py, the library this is the
command line of, and the modules it names.
"""

import sys
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as a file, the project's modules cannot be imported: say how to run it
    sys.exit("run it from the repository root as a module: python -m scripts.compare ...")

from config import ConfigError, apply_args, dataclass_fields, exit_on_config_error  # noqa: E402
from eval.compare import CompareError, warn  # noqa: E402
from eval.paired import paired, position_gain, render_paired, render_position_gain  # noqa: E402
from eval.plots import plot_all, plot_position_gain, seed_group_records  # noqa: E402
from eval.records import load_local_run, load_wandb_runs  # noqa: E402
from eval.tables import build_tables, render  # noqa: E402
from common.outputs import atomic_write, write_json  # noqa: E402


@dataclass
class CompareConfig:
    run_dirs: str = ""  # comma-separated run folders (train.py out_dirs; or given as positional arguments)
    plot: bool = False  # write loss/ppl/retrieval PNGs and compare.md into --out
    # folder for compare.md, the PNGs and the paired JSON (empty: the first run's parent/compare, or ./compare_out
    # for --wandb)
    out: str = ""
    wandb: str = ""  # ENTITY/PROJECT: read the runs from wandb instead of folders
    runs: str = ""  # comma-separated run names to keep
    columns: str = ""  # comma-separated substrings: keep only the eval columns containing one (e.g. ppl@L=4096,niah)
    # RUN_A,RUN_B (or --paired RUN_A RUN_B): paired statistics of two runs' per-example results (folders, or
    # names of given runs)
    paired: str = ""
    task: str = ""  # the eval task for --paired (eval/TASK.json)
    key: str = "correct"  # the per_example field to pair
    by: str = ""  # also pair within each value of this per_example field (e.g. length)
    n_boot: int = 10000  # bootstrap replicates
    boot_seed: int = 0  # bootstrap seed
    # RUN: each seed group's NLL gain over RUN's group by window position and by offset from the block boundaries
    # (ppl evals; paper 004's Fig. 5)
    position_gain: str = ""
    position_length: int = 0  # the ppl length for --position_gain (0: RUN's block_size)
    position_block: int = 0  # block length for --position_gain (0: RUN's block_len)
    position_bin: int = 16  # positions per bin for --position_gain (paper 004's Fig. 5)


def parse_args(argv) -> CompareConfig:
    argv = list(argv)
    if "--paired" in argv:  # the two-run form --paired RUN_A RUN_B
        i = argv.index("--paired")
        if len(argv) > i + 2 and not argv[i + 1].startswith("-") and not argv[i + 2].startswith("-"):
            argv[i:i + 3] = [f"--paired={argv[i + 1]},{argv[i + 2]}"]
    args = CompareConfig()
    apply_args(args, argv, dataclass_fields(CompareConfig), positional="run_dirs")
    if args.paired and len(args.paired.split(",")) != 2:
        raise ConfigError(f"--paired={args.paired!r}: two runs, --paired=RUN_A,RUN_B (or --paired RUN_A RUN_B)")
    if args.paired and not args.task:
        raise ConfigError("--paired needs --task (e.g. --task niah)")
    if args.task and not args.paired:
        raise ConfigError("--task is used with --paired RUN_A RUN_B")
    if not (args.run_dirs or args.wandb or args.paired):
        raise ConfigError("give run folders, --wandb ENTITY/PROJECT, or --paired RUN_A RUN_B --task TASK")
    if args.wandb and args.run_dirs:
        raise ConfigError("give run folders or --wandb, not both")
    if min(args.n_boot, args.position_bin) < 1 or min(args.position_length, args.position_block) < 0:
        raise ConfigError("need n_boot >= 1, position_bin >= 1, position_length >= 0 and position_block >= 0")
    return args


def main(argv=None) -> int:
    args = exit_on_config_error(parse_args, sys.argv[1:] if argv is None else argv)
    names = [n for n in args.runs.split(",") if n]
    run_dirs = [d for d in args.run_dirs.split(",") if d]
    pair_names = [p for p in args.paired.split(",") if p]
    if args.wandb:
        records = load_wandb_runs(args.wandb, names)
    else:
        records = []
        for path in run_dirs:
            if (Path(path) / "compare.md").is_file() and not (Path(path) / "config.json").exists():
                warn(f"{path} is a compare output folder; skipped")  # `out/*` after a --plot into out/compare
                continue
            try:
                records.append(load_local_run(path))
            except CompareError as e:
                if len(run_dirs) == 1:
                    raise
                warn(f"{e}; skipped")  # e.g. `out/*/` also matching a folder that is not a run
        if run_dirs and not records:
            raise CompareError(f"none of {', '.join(run_dirs)} is a run folder (config.json and metrics.jsonl)")
    if names:
        found = {r["name"] for r in records}
        missing = [n for n in names if n not in found]
        if missing:
            raise CompareError(f"--runs: no run named {', '.join(missing)} (runs: {', '.join(sorted(found))})")
        records = [r for r in records if r["name"] in names]
    seen: dict[str, int] = {}
    for r in records:  # the same folder name under different parents: name them parent/name
        seen[r["name"]] = seen.get(r["name"], 0) + 1
    for r in records:
        if seen[r["name"]] > 1 and not r["source"].startswith("wandb:"):
            r["name"] = "/".join(Path(r["source"]).resolve().parts[-2:])

    if args.out:
        out_dir = Path(args.out)
    elif run_dirs:
        out_dir = Path(run_dirs[0]).resolve().parent / "compare"
    elif args.paired:
        out_dir = Path(pair_names[0]).resolve().parent / "compare"
    else:
        out_dir = Path("compare_out")

    if records:
        tables = build_tables(records, [c for c in args.columns.split(",") if c])
        text = render(tables)
        gain = None
        if args.position_gain:
            gain = position_gain(tables, records, args.position_gain, args.position_length or None,
                                 args.position_block or None, args.position_bin)
            text += "\n## NLL by window position\n\n" + render_position_gain(gain) + "\n"

        print(text, end="")
        if args.plot or args.out:
            out_dir.mkdir(parents=True, exist_ok=True)
            atomic_write(out_dir / "compare.md", lambda f: f.write(text.encode()))
            print(f"wrote {out_dir / 'compare.md'}", file=sys.stderr)
        if args.plot:
            plotted = plot_all(seed_group_records(records, tables), out_dir)
            for path in plotted + ([plot_position_gain(gain, out_dir)] if gain else []):
                print(f"wrote {path}", file=sys.stderr)

    if args.paired:
        by_name = {r["name"]: r for r in records}
        pair = [by_name[p] if p in by_name and not Path(p).is_dir() else load_local_run(p) for p in pair_names]
        result = paired(*pair, task=args.task, key=args.key, by=args.by or None, n_boot=args.n_boot,
                        seed=args.boot_seed)
        if records:
            print()
        test = "exact McNemar" if result["all"]["binary"] else "exact sign test"
        print(f"## Paired comparison on {args.task} ({args.key}; {test}, paired bootstrap "
              f"n_boot={args.n_boot})\n")
        print(render_paired(result))
        out_dir.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{pair[0]['name']}_vs_{pair[1]['name']}")
        path = out_dir / f"paired_{args.task}_{safe}.json"
        write_json(result, path)
        print(f"\nwrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
