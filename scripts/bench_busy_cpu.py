"""Quick-start training throughput on the CPU on a quiet machine and beside busy processes, under each OpenMP
setting: how much a busy machine slows CPU training, and what the default (machine.passive_openmp) keeps.

    python -m scripts.bench_busy_cpu                        # 60 steps, 2 repeats, one busy process
    python -m scripts.bench_busy_cpu --steps=100 --repeats=3 --busy=1 --json=out/bench_busy_cpu.json

Each measurement is `python train.py configs/quickstart.py` for --steps steps in a fresh process (tokens/s over
the steps after the first log interval); "busy" starts --busy processes that spin one core each beside it. The
settings run interleaved, --repeats times, and the median is reported. Compare in one run: the machine's load
from elsewhere moves every number.
"""

import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, the project's modules cannot be imported: say how to run it
    sys.exit("run it from the repository root as a module: python -m scripts.bench_busy_cpu ...")

from config import ConfigError, apply_args, dataclass_fields, exit_on_config_error  # noqa: E402
from common.outputs import write_json  # noqa: E402
from common.run_folder import read_metrics  # noqa: E402

CORES = os.cpu_count() or 1
SETTINGS = {  # the environment each setting adds (the default adds nothing: what train.py does by itself)
    "default (passive wait)": {},
    "spinning wait (OpenMP's default; before)": {"GOMP_SPINCOUNT": "300000"},
    "1 thread": {"OMP_NUM_THREADS": "1"},
}
SPIN = "while True: pass"


def tokens_per_s(env: dict, steps: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([sys.executable, "train.py", "configs/quickstart.py", f"--out_dir={out}/run",
                               f"--max_iters={steps}", "--eval_interval=100000", "--eval_iters=1", "--log_interval=10"],
                              cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"training failed:\n{proc.stderr[-2000:]}")
        records = read_metrics(Path(out) / "run" / "metrics.jsonl")
        rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r and r["step"] > 10]
        return sum(rates) / len(rates)


@dataclass
class BusyConfig:
    steps: int = 60  # training steps per measurement
    repeats: int = 2  # each setting's measurements (the median is reported)
    busy: int = 1  # spinning processes beside the busy runs
    settings: str = ""  # comma-separated indices into the settings (empty: all)
    json: str = ""  # also write the results here


def parse(argv) -> BusyConfig:
    args = BusyConfig()
    apply_args(args, argv, dataclass_fields(BusyConfig))
    if args.steps < 12 or args.repeats < 1 or args.busy < 0:
        raise ConfigError("need steps >= 12 (tokens/s is read after step 10), repeats >= 1 and busy >= 0")
    if any(not i.strip().isdigit() or int(i) >= len(SETTINGS) for i in args.settings.split(",") if args.settings):
        raise ConfigError(f"settings={args.settings!r}: comma-separated indices below {len(SETTINGS)}")
    return args


def main(argv=None):
    args = exit_on_config_error(parse, sys.argv[1:] if argv is None else argv)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    os.environ.clear()
    os.environ.update(env)
    names = list(SETTINGS)
    if args.settings:
        names = [names[int(i)] for i in args.settings.split(",")]
    results = {name: {"quiet": [], "busy": []} for name in names}
    for repeat in range(args.repeats):
        for condition in ("quiet", "busy"):
            spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.busy if condition == "busy" else 0)]
            try:
                for name in names:
                    rate = tokens_per_s(SETTINGS[name], args.steps)
                    results[name][condition].append(rate)
                    print(f"repeat {repeat + 1} {condition:<5} {name:<40} {rate / 1e3:6.1f}k tokens/s", flush=True)
            finally:
                for p in spinners:
                    p.kill()
    reference = statistics.median(results[names[0]]["quiet"])
    print(f"\nquick start, {args.steps} steps, {CORES} cores, median of {args.repeats}; busy: {args.busy} spinning "
          f"process(es) beside it\n")
    print("| setting | quiet tokens/s | busy tokens/s | quiet / busy | quiet vs default quiet |")
    print("|---|---|---|---|---|")
    rows = []
    for name in names:
        quiet, busy = (statistics.median(results[name][c]) for c in ("quiet", "busy"))
        rows.append({"setting": name, "env": SETTINGS[name], "quiet": quiet, "busy": busy, "runs": results[name]})
        print(f"| {name} | {quiet / 1e3:.1f}k | {busy / 1e3:.1f}k | {quiet / busy:.2f}x | {quiet / reference:.2f} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_json({"cores": CORES, "steps": args.steps, "busy": args.busy, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
