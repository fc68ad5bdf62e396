"""A run as the comparison's plain record: read from a run folder (config.json, metrics.jsonl, eval/<task>.json)
or from a wandb run, with the checks that refuse what is not a run or what was evaluated on another tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from data.meta import tokenizer_identity, tokenizer_mismatch
from eval.compare import CompareError, is_number, warn
from common.run_folder import on_current_data, read_metrics

STANDARD_METRICS = {"step", "train_loss", "val_loss", "best_val_loss", "lr", "tokens_per_s", "mfu", "tokens_seen",
                    "elapsed_s"}


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CompareError(f"{path} is not valid JSON (line {e.lineno}: {e.msg})") from None
    except OSError as e:
        raise CompareError(f"cannot read {path}: {e.strerror}") from None


def make_record(name: str, source: str, config: dict, train: list, val: list, extra: dict | None = None,
                evals: dict | None = None, n_params: int | None = None, best_val_loss: float | None = None,
                final_train_loss: float | None = None, speed: dict | None = None) -> dict:
    """The internal record of one run, built from plain values (local folders and wandb runs alike).

    train / val: [(step, loss), ...]; extra: {metric: last value}; evals: {task: {"rows": [...],
    "per_example": [...] or None, "provenance": {...}}}. best_val_loss defaults to min(val) and
    final_train_loss to the loss at the last training step. speed: {"tokens_per_s", "mfu", "wall_s"} (training_speed).
    """
    train = sorted((int(s), float(v)) for s, v in train)
    val = sorted((int(s), float(v)) for s, v in val)
    if best_val_loss is None and any(step > 0 for step, _ in val):  # step 0 is the untrained model, never "best"
        best_val_loss = min(v for step, v in val if step > 0)
    if final_train_loss is None and train:
        final_train_loss = train[-1][1]
    last = train[-1][0] if train else None
    max_iters = (config.get("train") or {}).get("max_iters") if isinstance(config.get("train"), dict) else None
    # a run stopped before max_iters (interrupted, or still running): its numbers are not the finished run's
    incomplete = last is not None and is_number(max_iters) and last < max_iters
    speed = speed or {}
    return {"name": name, "source": source, "config": config, "n_params": n_params, "train": train, "val": val,
            "tokens_per_s": speed.get("tokens_per_s"), "mfu": speed.get("mfu"), "wall_s": speed.get("wall_s"),
            "best_val_loss": best_val_loss, "final_train_loss": final_train_loss, "last_train_step": last,
            "incomplete": f"stopped at step {last} of {max_iters}" if incomplete else "",
            "extra": extra or {}, "evals": evals or {}}


def load_evals(run_dir: Path) -> dict:
    evals = {}
    for path in sorted((run_dir / "eval").glob("*.json")):
        try:
            data = _read_json(path)
        except CompareError as e:
            warn(f"{e}; skipped")
            continue
        if not isinstance(data, dict):
            warn(f"{path} is not an evaluation result; skipped")
            continue
        results = data.get("results") or {}
        rows = results.get("rows", []) if isinstance(results, dict) else []
        evals[data.get("task") or path.stem] = {"rows": [r for r in rows if isinstance(r, dict)],
                                                "settings": data.get("settings") if isinstance(data.get("settings"), dict) else {},
                                                "trained_window": results.get("trained_window") if isinstance(results, dict) else None,
                                                "per_example": data.get("per_example"),
                                                "positions": results.get("positions") if isinstance(results, dict) else None,
                                                "provenance": data.get("provenance") or {}, "path": str(path)}
    return evals


def evaluation_only(path: Path) -> bool:
    """A folder of python -m eval --hf=...: a config.json and eval/ results of a model that was not trained here
    (their provenance has no checkpoint step)."""
    for result in sorted((path / "eval").glob("*.json")):
        try:
            return _read_json(result).get("provenance", {}).get("step", 0) is None
        except (CompareError, AttributeError):
            return False
    return False


def check_run_dir(path: Path) -> None:
    if not path.exists():
        raise CompareError(f"{path}: no such run folder")
    if not path.is_dir():
        raise CompareError(f"{path} is not a run folder (it is a file; give the out_dir of a train.py run)")
    missing = [f for f in ("config.json", "metrics.jsonl") if not (path / f).is_file()]
    if missing == ["metrics.jsonl"] and evaluation_only(path):
        return
    if missing:
        raise CompareError(f"{path} is not a run folder: missing {' and '.join(missing)} "
                           "(a train.py out_dir has both)")


def load_local_run(path) -> dict:
    path = Path(path)
    check_run_dir(path)
    config = _read_json(path / "config.json")
    if not isinstance(config, dict):
        raise CompareError(f"{path / 'config.json'} does not hold a config object")
    metrics = read_metrics(path / "metrics.jsonl", warn) if (path / "metrics.jsonl").is_file() else []
    train = [(m["step"], m["train_loss"]) for m in metrics if is_number(m.get("train_loss"))]
    current = on_current_data(metrics)
    if len(current) < len(metrics):  # a resume on other data: validation losses of two datasets never mix
        changed_at = [m["step"] for m in metrics if "data_change" in m][-1]
        warn(f"{path}: its data changed at step {changed_at} (--allow_data_change=True); its validation losses and "
             "best here are those on the new data, from that step on")
    val = [(m["step"], m["val_loss"]) for m in current if is_number(m.get("val_loss"))]
    extra = {}
    for m in sorted(metrics, key=lambda m: m["step"]):  # last value of every other numeric key
        for key, value in m.items():
            if key not in STANDARD_METRICS and is_number(value):
                extra[key] = float(value)
    name = path.resolve().name
    evals = load_evals(path)
    check_eval_tokenizers(path, config, evals)
    return make_record(name, str(path), config, train, val, extra, evals, speed=training_speed(metrics))


def training_speed(metrics: list[dict]) -> dict:
    """The run's training speed from its metrics.jsonl: the median tokens/s and MFU of its logged steps (each
    invocation's first logged step left out: it carries compilation), and its wall time (elapsed_s of the last
    step, counted over every invocation; None for runs logged before it was recorded)."""
    steps = [m for m in metrics if is_number(m.get("tokens_per_s"))]
    warm = [m for i, m in enumerate(steps) if i > 0 and m["step"] > steps[i - 1]["step"]
            and (not is_number(m.get("elapsed_s")) or not is_number(steps[i - 1].get("elapsed_s"))
                 or m["elapsed_s"] >= steps[i - 1]["elapsed_s"])] or steps

    def median(key):
        values = sorted(float(m[key]) for m in warm if is_number(m.get(key)))
        return values[len(values) // 2] if values else None
    elapsed = [float(m["elapsed_s"]) for m in steps if is_number(m.get("elapsed_s"))]
    return {"tokens_per_s": median("tokens_per_s"), "mfu": median("mfu"), "wall_s": max(elapsed) if elapsed else None}


def check_eval_tokenizers(path: Path, config: dict, evals: dict) -> None:
    """Refuse a run whose evaluation read data of another tokenizer than the run trained on (its numbers mean
    nothing): each result's provenance records the data's tokenizer, config.json the training data's."""
    data_meta = config.get("data_meta")
    if not isinstance(data_meta, dict) or "tokenizer" not in data_meta:
        return  # a --hf evaluation folder, or a run from before data_meta was saved
    for task, result in evals.items():
        scored = result["provenance"].get("data_tokenizer")
        if isinstance(scored, dict) and "tokenizer" in scored:
            problem = tokenizer_mismatch(tokenizer_identity(data_meta), scored, "its evaluation data", f"the run {path}")
            if problem:
                raise CompareError(f"{result['path']}: {problem}; then re-run python -m eval --out_dir={path}")


def _unpack_history(rows) -> list[dict]:
    if hasattr(rows, "to_dict"):  # a pandas DataFrame
        rows = rows.to_dict("records")
    return [dict(r) for r in rows or []]


def wandb_record(run, history_samples: int = 2000) -> dict:
    """A wandb run (public API object) as the internal record: run.config holds the same {model, data, train,
    eval} groups as config.json (data being the data config there, not the prepared data's meta), run.summary
    the last value of each metric, run.history the sampled curves."""
    config = dict(run.config)
    try:
        summary = dict(run.summary.items())
    except AttributeError:
        summary = dict(run.summary)

    def curve(key):
        rows = _unpack_history(run.history(keys=[key], samples=history_samples, pandas=False))
        return [(r["_step"], r[key]) for r in rows if is_number(r.get(key)) and is_number(r.get("_step"))]

    train, val = curve("train_loss"), curve("val_loss")
    best = [v for v in [summary.get("best_val_loss"), *(v for _, v in val)] if is_number(v)]
    extra = {k: float(v) for k, v in summary.items()
             if not k.startswith("_") and k not in STANDARD_METRICS and is_number(v)}
    n_params = config.get("n_params") if is_number(config.get("n_params")) else None
    final = summary.get("train_loss") if is_number(summary.get("train_loss")) else None
    speed_rows = {}
    for key in ("tokens_per_s", "mfu", "elapsed_s"):
        for step, value in curve(key):
            speed_rows.setdefault(step, {"step": step})[key] = value
    return make_record(run.name, f"wandb:{'/'.join(run.path) if isinstance(run.path, (list, tuple)) else run.path}",
                       config, train, val, extra, {}, n_params=n_params, best_val_loss=min(best) if best else None,
                       final_train_loss=final, speed=training_speed([speed_rows[s] for s in sorted(speed_rows)]))


def load_wandb_runs(path: str, names: list[str] | None = None) -> list[dict]:
    import wandb  # optional, and slow to import: only --wandb needs it

    records = []
    try:
        runs = list(wandb.Api().runs(path))
    except Exception as e:  # no login, no network, or no such project: wandb raises many kinds
        raise CompareError(f"cannot read {path} from wandb ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}): "
                           "without a login or network, compare the local run folders instead "
                           "(python -m scripts.compare out/RUN_A out/RUN_B ...)") from None
    for run in runs:
        if names and run.name not in names:
            continue
        records.append(wandb_record(run))
    if not records:
        raise CompareError(f"no wandb runs in {path}" + (f" named {', '.join(names)}" if names else ""))
    return records
