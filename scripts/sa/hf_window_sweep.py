"""Paper 000's training-free sweep (§4.2, Fig. 4, Tables 4-5): a pretrained model's accuracy on
lm-evaluation-harness tasks with full attention, and with SWA, SA and MoBA at growing effective windows.

    python -m scripts.sa.hf_window_sweep --hf=Qwen/Qwen3-8B --hf_dtype=bfloat16 --device=cuda --batch_size=8 \\
        --tasks=hellaswag,mmlu,lambada_openai,arc_easy,arc_challenge,boolq,humaneval \\
        --windows=16,32,64,128,256,512 --moba_blocks=32,64,128,256 --moba_topk=2 --out=out/qwen3_8b_sweep

The model is loaded once; each mode re-patches its attention layers (attention/hf.py) and is scored through
the repository's lm-eval adapter (eval/lm_eval_adapter.py). As in the paper the variant applies to the
prompt's forward only and generation decodes over the full KV cache (--hf_decode=full); sa draws one
permutation per layer and forward (--sa_mode=deterministic fixes them per layer from --sa_seed).
Effective window: w for swa and sa, moba_block x moba_topk for moba (the paper's c x k).

Writes OUT/results.json (every cell with its metric), OUT/table.md (Tables 4-5's layout: one row per mode and
window, one column per task, then the average) and OUT/accuracy_vs_window.png (Fig. 4: average accuracy
against the effective window, full attention as a dashed line) with OUT/accuracy_by_task.png (Figs. 5-6).
Tasks live on the Hugging Face hub (downloaded on first use); --include_path adds local task YAMLs. HumanEval
executes generated code: lm_eval asks for HF_ALLOW_CODE_EVAL=1 and --confirm_run_unsafe_code. A rerun into the
same --out under the same settings adds and replaces cells (the others are kept); under other settings
(model, tasks, --limit, ...) it is refused.
"""

import json
import os
import sys
import time
from dataclasses import asdict, dataclass

if not __package__:  # run as a file, the project's modules cannot be imported: say how to run it
    sys.exit("run it from the repository root as a module: python -m scripts.sa.hf_window_sweep ...")

from config import ConfigError, apply_args, dataclass_fields, exit_on_config_error, resolve_device  # noqa: E402
from runtime.checkpoint import git_hash  # noqa: E402
from common.outputs import atomic_write, markdown_table, save_figure, write_json  # noqa: E402

# the score of each task in the paper's tables: accuracy for multiple choice and LAMBADA, pass@1 for HumanEval
METRICS = ("acc,none", "pass@1,create_test", "pass_at_1,none", "exact_match,none", "exact_match,strict-match")


def modes(windows: list[int], moba_blocks: list[int], moba_topk: int) -> list[dict]:
    """Every cell of the sweep: (mode, effective window, attention settings)."""
    cells = [{"mode": "full", "window": None, "settings": {"attn_pattern": "full"}}]
    for w in windows:
        cells.append({"mode": "swa", "window": w, "settings": {"attn_pattern": "swa", "swa_window": w}})
        cells.append({"mode": "sa", "window": w, "settings": {"attn_pattern": "sa", "swa_window": w}})
    for c in moba_blocks:
        cells.append({"mode": "moba", "window": c * moba_topk,
                      "settings": {"attn_pattern": "moba", "moba_block": c, "moba_topk": moba_topk}})
    return cells


# the arguments a score depends on: a sweep's folder holds cells computed under one choice of them
SCORE_ARGUMENTS = ("hf", "tasks", "hf_dtype", "hf_decode", "hf_context", "sa_mode", "sa_seed", "limit", "num_fewshot",
                   "include_path", "seed")


def earlier_rows(path: str, args, cells: list[dict]) -> list[dict]:
    """The rows of an earlier sweep in the same --out that this one does not recompute, kept beside its new rows;
    a sweep there under other settings is refused (its numbers and these would read as one table)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        previous = json.load(f)
    before = previous.get("args", {})
    now = recorded(args)
    differ = [key for key in SCORE_ARGUMENTS if before.get(key) != now[key]]
    if differ:
        print(f"error: {os.path.dirname(path)} holds a sweep under other settings ("
              + ", ".join(f"--{key}={before.get(key)!r} there, {now[key]!r} here" for key in differ)
              + "): give --out another folder, or rerun with its settings to add cells to it", file=sys.stderr)
        sys.exit(2)
    recomputed = {cell_key(cell) for cell in cells}
    return [row for row in previous.get("rows", []) if cell_key(row) not in recomputed]


def cell_key(cell: dict) -> str:
    return json.dumps(cell["settings"], sort_keys=True)


def task_score(task: str, results: dict) -> tuple[str, float]:
    """(metric, value) of one task's lm_eval results: the first of METRICS it reports."""
    for metric in METRICS:
        if isinstance(results.get(metric), (int, float)):
            return metric, float(results[metric])
    raise ValueError(f"task {task} reports no accuracy ({', '.join(sorted(k for k in results if ',' in k))}): the "
                     f"sweep averages accuracies ({', '.join(METRICS)})")


def table(rows: list[dict], tasks: list[str]) -> str:
    return markdown_table(["mode", "window", *tasks, "average"],
                          [[row["mode"], row["window"] or "-", *(f"{100 * row['scores'][t]:.1f}" for t in tasks),
                            f"{100 * row['average']:.1f}"] for row in rows]) + "\n"


def plot(rows: list[dict], tasks: list[str], out: str, title: str) -> list[str]:
    """Fig. 4 (the average) and Figs. 5-6 (each task) as PNGs; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"swa": "tab:blue", "sa": "tab:red", "moba": "tab:green"}
    full = next((row for row in rows if row["mode"] == "full"), None)
    paths = []
    for name, panels in (("accuracy_vs_window", ["average"]), ("accuracy_by_task", tasks)):
        cols = min(4, len(panels))
        rows_n = -(-len(panels) // cols)
        fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.4 * rows_n), squeeze=False)
        for ax, panel in zip(axes.flat, panels):
            value = (lambda row: row["average"]) if panel == "average" else (lambda row, p=panel: row["scores"][p])
            for mode, color in colors.items():
                points = sorted((row["window"], 100 * value(row)) for row in rows if row["mode"] == mode)
                if points:
                    ax.plot(*zip(*points), "o-", color=color, label=mode)
            if full is not None:
                ax.axhline(100 * value(full), color="gray", linestyle="--", label="full")
            ax.set_xscale("log", base=2)
            ticks = sorted({row["window"] for row in rows if row["window"] is not None})
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.minorticks_off()
            ax.set_xlabel("effective window")
            ax.set_ylabel("average accuracy (%)" if panel == "average" else "accuracy (%)")
            ax.set_title(title if panel == "average" else panel)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        axes.flat[0].legend()
        fig.tight_layout()
        path = os.path.join(out, f"{name}.png")
        paths.append(save_figure(fig, path))
    return paths


@dataclass
class WindowSweepConfig:
    hf: str = ""  # hub name or save_pretrained folder of a causal LM (required)
    tasks: str = ""  # comma-separated lm-eval tasks (required)
    out: str = ""  # output folder (required)
    windows: str = "16,32,64,128,256,512"  # swa and sa windows
    moba_blocks: str = "32,64,128,256"  # moba block sizes c (empty: no moba)
    moba_topk: int = 2
    modes: str = "full,swa,sa,moba"  # which modes to run
    hf_dtype: str = "float32"
    hf_decode: str = "full"  # full | variant: how generation decodes past the prompt
    hf_context: int = 4096  # longest input (lm-eval's max_length)
    sa_mode: str = "stochastic"  # stochastic | deterministic
    sa_seed: int = 0
    device: str = "auto"  # auto (cuda when available) | cpu | cuda | cuda:N
    batch_size: int = 8
    limit: int = 0  # examples per task, for quick checks (0: all)
    num_fewshot: int = -1  # few-shot examples (-1: each task's own)
    include_path: str = ""  # folder of extra task YAMLs
    seed: int = 0
    confirm_run_unsafe_code: bool = False  # needed by code tasks (HumanEval)


def parse(argv) -> WindowSweepConfig:
    args = WindowSweepConfig()
    apply_args(args, argv, dataclass_fields(WindowSweepConfig))
    missing = [f"--{key}" for key in ("hf", "tasks", "out") if not getattr(args, key)]
    if missing:
        raise ConfigError(f"{', '.join(missing)} required (--help lists the options)")
    for key in ("windows", "moba_blocks"):
        if not all(x.strip().isdigit() for x in getattr(args, key).split(",") if x):
            raise ConfigError(f"{key}={getattr(args, key)!r}: comma-separated integers, e.g. 16,32,64")
    wanted = set(args.modes.split(","))
    if wanted - {"full", "swa", "sa", "moba"} or not wanted:
        raise ConfigError(f"modes={args.modes!r}: expected some of full, swa, sa, moba")
    if args.hf_decode not in ("full", "variant") or args.sa_mode not in ("stochastic", "deterministic"):
        raise ConfigError(f"hf_decode={args.hf_decode!r}, sa_mode={args.sa_mode!r}: expected full or variant, and "
                          "stochastic or deterministic")
    if args.limit < 0 or args.batch_size < 1 or args.hf_context < 1 or args.num_fewshot < -1:
        raise ConfigError("need limit >= 0, batch_size >= 1, hf_context >= 1 and num_fewshot >= -1 (-1: each task's "
                          "own)")
    return args


def recorded(args: WindowSweepConfig) -> dict:
    """The settings as results.json records them: None where lm-eval takes its own default."""
    return {**asdict(args), "limit": args.limit or None, "include_path": args.include_path or None,
            "num_fewshot": None if args.num_fewshot < 0 else args.num_fewshot}


def main(argv=None):
    args = exit_on_config_error(parse, sys.argv[1:] if argv is None else argv)
    windows = [int(x) for x in args.windows.split(",") if x]
    moba_blocks = [int(x) for x in args.moba_blocks.split(",") if x]
    wanted = set(args.modes.split(","))
    tasks = [t for t in args.tasks.split(",") if t]
    cells = [cell for cell in modes(windows, moba_blocks, args.moba_topk) if cell["mode"] in wanted]
    rows = earlier_rows(os.path.join(args.out, "results.json"), args, cells)  # before any work: refusals first

    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        print("error: the window sweep runs lm-evaluation-harness, which is not installed: pip install -r "
              "requirements-eval.txt", file=sys.stderr)
        sys.exit(2)

    from eval.lm_eval_adapter import EfficientAttentionLM  # imports lm_eval, checked above

    # a GPU asked for and missing is an error, never a silent hours-long CPU run
    device = exit_on_config_error(resolve_device, args.device)
    try:  # lm_eval's own HFLM loads the model and its tokenizer once; each cell puts its variant in the layers
        lm = EfficientAttentionLM(pretrained=args.hf, device=device, dtype=args.hf_dtype, batch_size=args.batch_size,
                                  max_length=args.hf_context)
    except (OSError, ValueError) as e:
        print(f"error: cannot load {args.hf!r}: {str(e).splitlines()[0][:300]}", file=sys.stderr)
        sys.exit(1)
    task_manager = TaskManager(include_path=args.include_path) if args.include_path else TaskManager()
    os.makedirs(args.out, exist_ok=True)
    settings = recorded(args)  # as results.json records them
    for i, cell in enumerate(cells):
        lm.use_variant(hf_decode=args.hf_decode, **cell["settings"], sa_mode=args.sa_mode, sa_seed=args.sa_seed)
        started = time.time()  # simple_evaluate seeds torch: sa draws the same permutations in every run
        results = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager,
                                          limit=settings["limit"], num_fewshot=settings["num_fewshot"],
                                          bootstrap_iters=0, random_seed=args.seed,
                                          numpy_random_seed=args.seed, torch_random_seed=args.seed,
                                          fewshot_random_seed=args.seed,
                                          confirm_run_unsafe_code=args.confirm_run_unsafe_code)["results"]
        metrics = {task: task_score(task, results[task]) for task in tasks}
        scores = {task: value for task, (_, value) in metrics.items()}
        rows.append({**cell, "scores": scores, "metrics": {t: m for t, (m, _) in metrics.items()},
                     "average": sum(scores.values()) / len(scores), "seconds": round(time.time() - started, 1)})
        label = cell["mode"] + ("" if cell["window"] is None else f" w={cell['window']}")
        print(f"[{i + 1}/{len(cells)}] {label:<12} average {100 * rows[-1]['average']:.1f}  "
              + "  ".join(f"{t} {100 * s:.1f}" for t, s in scores.items()), flush=True)
        # written after every cell: an interrupted sweep keeps what it has measured
        write_json({"model": args.hf, "tasks": tasks, "rows": rows, "command": " ".join(sys.argv),
                    "git_hash": git_hash(), "args": settings}, os.path.join(args.out, "results.json"))
    atomic_write(os.path.join(args.out, "table.md"), lambda f: f.write(table(rows, tasks).encode()))
    paths = plot(rows, tasks, args.out, os.path.basename(args.hf.rstrip("/")))
    print(table(rows, tasks))
    print(f"wrote results.json, table.md, {', '.join(os.path.basename(p) for p in paths)} in {args.out}")


if __name__ == "__main__":
    main()
