"""Run comparison: training runs (local folders or wandb) as plain records, their table and seed groups, plots,
paired statistics on per-example results and the NLL gain by window position. scripts/compare.py is its command
line; wandb_run.py writes its summaries into a run's wandb summary.

A run folder is a train.py out_dir: config.json and metrics.jsonl, plus eval/<task>.json from `python -m
eval`. The table shows the config keys that differ across the runs, parameters, tokens seen (last training
step x batch_size x gradient_accumulation_steps x block_size), best validation loss, final training loss and
one summary column per evaluation result (ppl per length and window, NIAH rank accuracy per length averaged
over depth and kind, other tasks per length or overall). Runs whose configs differ only in `seed` form a
group; a second table gives each group's mean +- sample std over its seeds.

Local folders and wandb runs are both turned into the same plain record (see `load_local_run` and
`wandb_record`), and everything after that (tables, groups, plots) works on those records only.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import sys
from pathlib import Path

import numpy as np

from runtime import outputs
from eval.results import (data_label, describe_settings, own_data, reads_validation_text,
                          setting_items, setting_options, standing_setting)
from eval.stats import format_p, mean_std, paired_comparison
from runtime.outputs import save_figure
from runtime.run_folder import read_metrics


STANDARD_METRICS = {"step", "train_loss", "val_loss", "best_val_loss", "lr", "tokens_per_s", "mfu", "tokens_seen",
                    "elapsed_s"}
# config keys that name or log a run without changing what it computes
IGNORED_KEYS = {"out_dir", "wandb_run_name", "wandb_project", "wandb_log", "wandb_mode", "wandb_group", "wandb_tags", "init_from", "data.created",
                "data_meta.created"}  # data.created: the meta's, in runs written before data_meta
IGNORED_GROUPS = {"run", "provenance", "n_params", "invocations", "resolved"}
SEED_KEY = "seed"
# eval row fields that identify a row even when numeric, and counts that weight it (never metrics)
ROW_ID_KEYS = {"kind", "length", "window", "depth", "task", "name", "split", "subset"}
ROW_COUNT_KEYS = {"n", "tokens", "count", "total", "n_examples"}
FIXED_COLUMNS = ["params", "tokens", "best val loss", "final train loss", "tokens/s", "MFU", "wall time"]


class CompareError(Exception):
    """A problem with the inputs: printed as one line, exit status 2."""


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


# ---- records ----------------------------------------------------------------------------------------------

def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CompareError(f"{path} is not valid JSON (line {e.lineno}: {e.msg})") from None
    except OSError as e:
        raise CompareError(f"cannot read {path}: {e.strerror}") from None


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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
    incomplete = last is not None and _is_number(max_iters) and last < max_iters
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
    train = [(m["step"], m["train_loss"]) for m in metrics if _is_number(m.get("train_loss"))]
    val = [(m["step"], m["val_loss"]) for m in metrics if _is_number(m.get("val_loss"))]
    extra = {}
    for m in sorted(metrics, key=lambda m: m["step"]):  # last value of every other numeric key
        for key, value in m.items():
            if key not in STANDARD_METRICS and _is_number(value):
                extra[key] = float(value)
    name = path.resolve().name
    evals = load_evals(path)
    check_eval_tokenizers(path, config, evals)
    return make_record(name, str(path), config, train, val, extra, evals, speed=training_speed(metrics))


def training_speed(metrics: list[dict]) -> dict:
    """The run's training speed from its metrics.jsonl: the median tokens/s and MFU of its logged steps (each
    invocation's first logged step left out: it carries compilation), and its wall time (elapsed_s of the last
    step, counted over every invocation; None for runs logged before it was recorded)."""
    steps = [m for m in metrics if _is_number(m.get("tokens_per_s"))]
    warm = [m for i, m in enumerate(steps) if i > 0 and m["step"] > steps[i - 1]["step"]
            and (not _is_number(m.get("elapsed_s")) or not _is_number(steps[i - 1].get("elapsed_s"))
                 or m["elapsed_s"] >= steps[i - 1]["elapsed_s"])] or steps

    def median(key):
        values = sorted(float(m[key]) for m in warm if _is_number(m.get(key)))
        return values[len(values) // 2] if values else None
    elapsed = [float(m["elapsed_s"]) for m in steps if _is_number(m.get("elapsed_s"))]
    return {"tokens_per_s": median("tokens_per_s"), "mfu": median("mfu"), "wall_s": max(elapsed) if elapsed else None}


def check_eval_tokenizers(path: Path, config: dict, evals: dict) -> None:
    """Refuse a run whose evaluation read data of another tokenizer than the run trained on (its numbers mean
    nothing): each result's provenance records the data's tokenizer, config.json the training data's."""
    from data.meta import tokenizer_identity, tokenizer_mismatch

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
        return [(r["_step"], r[key]) for r in rows if _is_number(r.get(key)) and _is_number(r.get("_step"))]

    train, val = curve("train_loss"), curve("val_loss")
    best = [v for v in [summary.get("best_val_loss"), *(v for _, v in val)] if _is_number(v)]
    extra = {k: float(v) for k, v in summary.items()
             if not k.startswith("_") and k not in STANDARD_METRICS and _is_number(v)}
    n_params = config.get("n_params") if _is_number(config.get("n_params")) else None
    final = summary.get("train_loss") if _is_number(summary.get("train_loss")) else None
    speed_rows = {}
    for key in ("tokens_per_s", "mfu", "elapsed_s"):
        for step, value in curve(key):
            speed_rows.setdefault(step, {"step": step})[key] = value
    return make_record(run.name, f"wandb:{'/'.join(run.path) if isinstance(run.path, (list, tuple)) else run.path}",
                       config, train, val, extra, {}, n_params=n_params, best_val_loss=min(best) if best else None,
                       final_train_loss=final, speed=training_speed([speed_rows[s] for s in sorted(speed_rows)]))


def load_wandb_runs(path: str, names: list[str] | None = None) -> list[dict]:
    import wandb

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


# ---- config diff and derived values -----------------------------------------------------------------------

def _flatten(values: dict, prefix: str, out: dict) -> None:
    for key, value in values.items():
        if isinstance(value, dict):
            _flatten(value, f"{prefix}{key}.", out)
        else:
            out[f"{prefix}{key}"] = tuple(value) if isinstance(value, list) else value


def _defaults() -> dict:
    try:
        from config import Config

        return Config().to_dict()
    except Exception:
        return {}


def flat_config(config: dict, defaults: dict | None = None) -> dict:
    """{flat key: value}: model/train/eval keys by their own (unique) names, any other group as GROUP.KEY
    (data.dataset, data_meta.vocab_size: the prepared data's meta, whose vocab_size would clash). Keys a run's saved
    config lacks (written before the field existed) take the current default, as Config.from_dict does. A setting
    given as "auto" shows what it became in the run (config.json's "resolved", written by train.py), so runs are
    told apart by what ran (learned positions, the native mLSTM), not by what was asked."""
    out: dict = {}
    for group, values in config.items():
        if group in IGNORED_GROUPS or not isinstance(values, dict):
            continue
        merged = {**(defaults or {}).get(group, {}), **values} if group in ("model", "train", "eval") else values
        _flatten(merged, "" if group in ("model", "train", "eval") else f"{group}.", out)
    for key, value in (config.get("resolved") or {}).items():
        if out.get(key) == "auto":
            out[key] = value
    return out


_PARAMS_CACHE: dict = {}


def count_params(config: dict) -> int | None:
    """Parameters of the run's model, built on the meta device (no memory, no init); None if it cannot be built.
    vocab_size comes from the model config, or (when 0) from the data meta padded to a multiple of 64."""
    model_cfg = config.get("model")
    if not isinstance(model_cfg, dict):
        return None
    meta = config.get("data_meta") or config.get("data") or {}  # "data": the meta, in runs before data_meta
    vocab = model_cfg.get("vocab_size") or meta.get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 0:
        return None
    key = json.dumps({**model_cfg, "vocab_size": vocab}, sort_keys=True, default=str)
    if key not in _PARAMS_CACHE:
        try:
            import torch
            from config import Config
            from model import GPT

            with contextlib.redirect_stderr(io.StringIO()):  # from_dict warns about keys of other versions
                cfg = Config.from_dict({"model": model_cfg})
            cfg.model.vocab_size = vocab if model_cfg.get("vocab_size") else -(-vocab // 64) * 64
            with torch.device("meta"):
                _PARAMS_CACHE[key] = GPT(cfg.model).num_params()
        except Exception:
            _PARAMS_CACHE[key] = None
    return _PARAMS_CACHE[key]


def tokens_seen(record: dict, flat: dict) -> int | None:
    """last training step x batch_size x gradient_accumulation_steps x block_size (global batch: DDP divides
    gradient_accumulation_steps among processes)."""
    step = record["last_train_step"]
    factors = [flat.get(k) for k in ("batch_size", "gradient_accumulation_steps", "block_size")]
    if step is None or not all(_is_number(f) for f in factors):
        return None
    return int(step * factors[0] * factors[1] * factors[2])


def _weighted_mean(rows: list[dict], metric: str) -> float | None:
    """Mean of a metric over rows, weighted by each row's n when rows have one (rows with n = 0 drop out)."""
    pairs = [(r[metric], r["n"] if _is_number(r.get("n")) else 1) for r in rows if _is_number(r.get(metric))]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else None


def _row_fields(row: dict) -> tuple[list[str], list[str]]:
    """(identifying fields, metric fields) of a generic eval row: str/int fields and ROW_ID_KEYS identify it,
    other numeric (float) fields are metrics; counts and booleans are neither."""
    ids, metrics = [], []
    for key, value in row.items():
        if key in ROW_COUNT_KEYS or isinstance(value, bool):
            continue
        if key in ROW_ID_KEYS or isinstance(value, (str, int)) or value is None:
            ids.append(key)
        elif _is_number(value):
            metrics.append(key)
    return ids, metrics


def eval_summaries(evals: dict) -> dict:
    """{column: (sort key, value)}: one summary per (task, metric, length[, window]), not one per row.

    ppl: ppl per (length, window) -> "ppl@L=1024,w=128" ("ppl@L=1024" without a window).
    niah: RULER's score and the rank accuracy per length: the run's average over the subtasks when it has one
        (RULER's average), else the mean over depths and subtasks weighted by n -> "niah@L=1024", "niah_rank@L=1024".
    other tasks: each float metric per length when rows have one ("TASK_METRIC@L=..."), else over all rows.
    """
    out = {}
    for task, result in evals.items():
        for suffix, rows in rows_by_setting(result):
            out.update({name + suffix: value for name, value in task_summaries(task, result, rows).items()})
    return out


def eval_flags(evals: dict) -> dict:
    """{column: why its value is flagged}: perplexity cells scored on fewer than eval/ppl.py's MIN_WINDOWS windows."""
    out = {}
    for task, result in evals.items():
        if task != "ppl":
            continue
        for suffix, rows in rows_by_setting(result):
            for r in rows:
                if r.get("few_windows") and _is_number(r.get("ppl")) and _is_number(r.get("length")):
                    out[ppl_column(r, result.get("trained_window")) + suffix] = \
                        f"{r.get('windows')} windows, {r.get('tokens') or 0:,} tokens"
    return out


def ppl_column(row: dict, trained_window) -> str:
    w = row.get("window")
    w = None if w == trained_window else w  # the trained window is the model as trained: plain column
    return f"ppl@L={row['length']}" + (f",w={w}" if w is not None else "")


def rows_by_setting(result: dict) -> list[tuple[str, list[dict]]]:
    """A task's rows grouped by evaluation setting (eval/results.py), each with its column suffix: the setting that
    stands for the result (the one plots use) has the plain column when it was computed on the run's own
    validation split over all examples; other data is named (" (data NAME)") and a --limit=N evaluation said
    (" (limit N)"), never shown as if it were the run's full evaluation; another setting of the run that would
    share its column is told apart by its id."""
    rows = result.get("rows") or []
    settings = result.get("settings") or {}
    legacy_limit = ((result.get("provenance") or {}).get("eval_config") or {}).get("limit", 0)
    groups: dict = {}
    for row in rows:
        groups.setdefault(row.get("setting"), []).append(row)
    limit_of = lambda sid: (settings.get(sid) or {}).get("limit", legacy_limit if not settings else 0)  # noqa: E731

    def suffix(sid) -> str:
        parts = [data_label(settings.get(sid) or {}).replace("=", " "), f"limit {limit_of(sid)}" if limit_of(sid) else ""]
        return f" ({', '.join(p for p in parts if p)})" if any(parts) else ""

    suffixes = {sid: suffix(sid) for sid in groups}
    standing = standing_setting(result, among=set(groups))
    out = []
    for sid, group in groups.items():
        shared = [other for other in groups if suffixes[other] == suffixes[sid]]
        tell_apart = len(shared) > 1 and (sid != standing or standing not in shared)
        out.append((suffixes[sid] + (f" [setting {sid}]" if tell_apart else ""), group))
    return out


def task_summaries(task: str, result: dict, rows: list[dict]) -> dict:
    """eval_summaries for one setting's rows of a task."""
    out = {}
    if task == "ppl":
        trained = result.get("trained_window")
        for r in rows:
            if _is_number(r.get("ppl")) and _is_number(r.get("length")):
                w = None if r.get("window") == trained else r.get("window")
                out[ppl_column(r, trained)] = ((task, "ppl", -1 if w is None else w, r["length"]), float(r["ppl"]))
        return out
    metrics = ["score", "acc_rank"] if task == "niah" else sorted({m for r in rows for m in _row_fields(r)[1]})
    label = {"score": "niah", "acc_rank": "niah_rank"} if task == "niah" else {}
    for metric in metrics:
        prefix = label.get(metric, f"{task}_{metric}")
        lengths = sorted({r["length"] for r in rows if _is_number(r.get("length")) and metric in r})
        if lengths:
            for length in lengths:
                at_length = [r for r in rows if r.get("length") == length]
                averaged = [r for r in at_length if r.get("kind") == "average"]
                value = _weighted_mean(averaged or at_length, metric)
                if value is not None:
                    out[f"{prefix}@L={length}"] = ((task, metric, -1, length), value)
        else:
            value = _weighted_mean(rows, metric)
            if value is not None:
                out[prefix] = ((task, metric, -1, -1), value)
    return out


def _group_label(flat: dict, keys: list[str]) -> str:
    return ", ".join(f"{k}={_fmt_config(flat.get(k, MISSING))}" for k in keys) or "all"


def _group_name(group: dict) -> str:
    """A seed group's name for plots and tables: its runs' common name without the seed suffix (a sweep's
    CONFIG_sSEED folders), else the config values that set it apart ("attn_pattern=swa")."""
    stems = {re.sub(r"_s\d+$", "", name) for name in group["runs"]}
    return stems.pop() if len(stems) == 1 else group["label"]


class _Missing:
    def __repr__(self):
        return "-"


MISSING = _Missing()


def _fmt_config(value) -> str:
    if value is MISSING:
        return "-"
    if isinstance(value, tuple):
        return json.dumps(list(value))
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def mixer_settings_used(config: dict) -> set[str] | None:
    """The mixer settings (Mixer.settings) some layer of a run reads; None when its pattern cannot be read."""
    from types import SimpleNamespace

    from attention.registry import used_settings

    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    try:
        return used_settings(SimpleNamespace(attn_pattern=model.get("attn_pattern", "full"),
                                             n_layer=model.get("n_layer", 1)))
    except (ValueError, TypeError):
        return None


def build_tables(records: list[dict], columns: list[str] | None = None) -> dict:
    """Everything the output needs, from records only: {"diff_keys", "columns", "rows", "groups"}.

    rows: one dict per run {"run", "flat", "cells": {column: number}}; groups: seed groups (runs whose flat
    configs agree on every key but seed and IGNORED_KEYS), each {"label", "runs", "seeds", "flat",
    "stats": {column: (mean, std, count)}}. columns (substrings) filters the eval/metric columns.
    """
    defaults = _defaults()
    flats = [flat_config(r["config"], defaults) for r in records]
    keys: list[str] = []
    for flat in flats:
        keys += [k for k in flat if k not in keys]
    # a mixer setting counts only for the runs whose layers read it (swat_split means nothing to a full model)
    from attention.registry import mixer_settings

    settings = mixer_settings()
    used = [mixer_settings_used(r["config"]) for r in records]
    for flat, run_uses in zip(flats, used):
        for key in settings - (run_uses if run_uses is not None else settings):
            flat.pop(key, None)
    # a key differs when the runs hold different values; a mixer setting also when only some runs' layers read it
    # (swa(32) beside pbb(64, 32): the window tells them apart though every run that has one has 32)
    diff_keys = [k for k in keys if k not in IGNORED_KEYS
                 and (len({json.dumps(f.get(k, "\0missing"), default=str) for f in flats if k not in settings or k in f}) > 1
                      or k in settings and 0 < sum(k in f for f in flats) < len(flats))]
    rows, extra_cols = [], {}
    for record, flat in zip(records, flats):
        n_params = record["n_params"] if record["n_params"] is not None else count_params(record["config"])
        cells = {"params": n_params, "tokens": tokens_seen(record, flat), "best val loss": record["best_val_loss"],
                 "final train loss": record["final_train_loss"], "tokens/s": record.get("tokens_per_s"),
                 "MFU": record.get("mfu"), "wall time": record.get("wall_s")}
        summaries = eval_summaries(record["evals"])
        summaries.update({k: (("~", k, -1, -1), v) for k, v in record["extra"].items() if k not in summaries})
        for name, (sort_key, value) in summaries.items():
            extra_cols.setdefault(name, sort_key)
            cells[name] = value
        rows.append({"run": record["name"], "flat": flat, "cells": cells, "incomplete": record.get("incomplete", ""),
                     "flags": eval_flags(record["evals"])})
    task_order = {"ppl": 0, "niah": 1, "~": 3}  # ppl, niah, other tasks, then metrics.jsonl/summary values
    eval_cols = sorted(extra_cols, key=lambda c: (task_order.get(extra_cols[c][0], 2), extra_cols[c], c))
    if columns:
        eval_cols = [c for c in eval_cols if any(s in c for s in columns)]
    numeric_cols = FIXED_COLUMNS + eval_cols

    group_keys = [k for k in diff_keys if k != SEED_KEY]
    groups: dict[str, dict] = {}
    for row in rows:
        label = _group_label(row["flat"], group_keys)
        g = groups.setdefault(label, {"label": label, "runs": [], "seeds": [], "flat": row["flat"], "members": []})
        g["runs"].append(row["run"])
        g.setdefault("flags", set()).update(row["flags"])
        g["seeds"].append(row["flat"].get(SEED_KEY))
        g["members"].append(row)
    for g in groups.values():
        members = g.pop("members")
        g["stats"] = {}
        for col in numeric_cols:
            values = [m["cells"][col] for m in members if _is_number(m["cells"].get(col))]
            if values:
                mean, std = mean_std(values)
                g["stats"][col] = (mean, std, len(values))
    return {"diff_keys": diff_keys, "group_keys": group_keys, "columns": numeric_cols, "rows": rows,
            "groups": list(groups.values())}


# ---- formatting -------------------------------------------------------------------------------------------

def fmt_value(column: str, value) -> str:
    if not _is_number(value):
        return ""
    if column == "params":
        return f"{value / 1e6:.2f}M"
    if column == "tokens":
        if value >= 1e9:
            return f"{value / 1e9:.2f}B"
        return f"{value / 1e6:.2f}M" if value >= 1e7 else f"{round(value):,}"
    if "loss" in column:
        return f"{value:.4f}"
    if column == "tokens/s":
        return f"{value:,.0f}"
    if column == "MFU":
        return f"{100 * value:.1f}%"
    if column == "wall time":
        return f"{value / 3600:.1f} h" if value >= 3600 else f"{value / 60:.1f} min" if value >= 60 else f"{value:.0f} s"
    if column.startswith("ppl") or "acc" in column or "rank" in column:
        return f"{value:.3f}"
    return f"{value:.4g}"


def markdown_table(headers: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> str:
    return outputs.markdown_table(headers, rows, right, aligned=True)


FEW = " †"  # a cell scored on too little text (eval/ppl.py MIN_WINDOWS)


def _flagged(text: str, flagged: bool) -> str:
    return text + FEW if text and flagged else text


def render_runs(tables: dict) -> str:
    from eval.ppl import MIN_WINDOWS

    headers = ["run", *tables["diff_keys"], *tables["columns"]]
    first_num = 1 + len(tables["diff_keys"])
    body = [[row["run"] + (f" (incomplete: {row['incomplete']})" if row.get("incomplete") else ""),
             *(_fmt_config(row["flat"].get(k, MISSING)) for k in tables["diff_keys"]),
             *(_flagged(fmt_value(c, row["cells"].get(c)), c in row.get("flags", {})) for c in tables["columns"])]
            for row in tables["rows"]]
    notes = [f"{row['run']} {c}: {row['flags'][c]}" for row in tables["rows"] for c in tables["columns"]
             if c in row.get("flags", {})]
    table = markdown_table(headers, body, right=set(range(first_num, len(headers))))
    if notes:
        table += (f"\n\n† scored on fewer than {MIN_WINDOWS} windows (eval/ppl.py MIN_WINDOWS), a noisy "
                  "number: " + "; ".join(notes))
    return table


def render_groups(tables: dict) -> str:
    key_headers = tables["group_keys"] or ["group"]
    headers = [*key_headers, "seeds", "runs", *tables["columns"]]
    first_num = 2 + len(key_headers)
    body = []
    for g in tables["groups"]:
        n = len(g["runs"])
        seeds = [s for s in g["seeds"] if s is not None]
        cells = []
        for col in tables["columns"]:
            if col not in g["stats"]:
                cells.append("")
                continue
            mean, std, count = g["stats"][col]
            text = fmt_value(col, mean)
            if count > 1 and std > 0:
                text += f" ± {fmt_value(col, std)}"
            if count != n:
                text += f" (n={count})"
            cells.append(_flagged(text, col in g.get("flags", ())))
        keys = [_fmt_config(g["flat"].get(k, MISSING)) for k in tables["group_keys"]] or [g["label"]]
        if len(set(seeds)) < len(seeds):  # the same seed twice: repeated runs, not seed replicates
            distinct = sorted(set(seeds), key=str)
            count = f"{n} runs, {len(distinct)} seed{'s' if len(distinct) != 1 else ''} ({', '.join(map(str, distinct))}: " \
                    "repeated, not independent)"
        else:
            count = f"{n} seed{'s' if n != 1 else ''}" + (f" ({', '.join(map(str, seeds))})" if seeds else "")
        body.append([*keys, count, ", ".join(g["runs"]), *cells])
    return markdown_table(headers, body, right=set(range(first_num, len(headers))))


def render(tables: dict) -> str:
    out = ["## Runs", "", render_runs(tables)]
    if any(len(g["runs"]) > 1 for g in tables["groups"]):
        out += ["", "## Seed groups (mean ± sample std over seeds)", "", render_groups(tables)]
    return "\n".join(out) + "\n"


# ---- plots ------------------------------------------------------------------------------------------------

def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise CompareError("--plot needs matplotlib: pip install matplotlib") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, axes, path):
    """Grid, legend, layout, then write the figure as a PNG and close it; returns the path."""
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def _colors(plt, n):
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


def _log2_lengths(ax, lengths):
    ax.set_xscale("log", base=2)
    ticks = sorted(set(lengths))
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t // 1024}K" if t >= 1024 and t % 1024 == 0 else str(t) for t in ticks])
    ax.minorticks_off()


def unigram_baseline(record: dict) -> float | None:
    """The validation text's unigram entropy, which train.py saves with the data's meta in config.json."""
    meta = record["config"].get("data_meta") if isinstance(record["config"].get("data_meta"), dict) else {}
    value = meta.get("unigram_entropy")
    return float(value) if _is_number(value) else None


def _mean_curve(curves: list[list]) -> tuple[list, list]:
    """[(step, mean)] and [std] over the steps every curve has (sample std over the curves)."""
    common = set.intersection(*(set(step for step, _ in c) for c in curves)) if curves else set()
    values = [dict(c) for c in curves]
    stats = [(step, *mean_std([v[step] for v in values])) for step in sorted(common)]
    return [(step, m) for step, m, _ in stats], [sd for _, _, sd in stats]


def seed_group_records(records: list[dict], tables: dict) -> list[dict]:
    """What the plots draw: a seed group of several runs as one record (its name and seed count; loss curves
    and perplexities as means over the seeds, with their sample std for a band), other runs as they are."""
    by_name = {r["name"]: r for r in records}
    out = []
    for g in tables["groups"]:
        members = [by_name[n] for n in g["runs"]]
        if len(members) == 1:
            out.append(members[0])
            continue
        train, train_std = _mean_curve([m["train"] for m in members])
        val, val_std = _mean_curve([m["val"] for m in members])
        cells: dict = {}
        for m in members:
            for row in ppl_series(m["evals"].get("ppl", {}))[0]:
                cells.setdefault((row["length"], row.get("window")), []).append(row["ppl"])
        ppl_rows = [{"length": length, "window": window, "ppl": mean, "ppl_std": std}
                    for (length, window), values in cells.items() if len(values) == len(members)
                    for mean, std in [mean_std(values)]]
        niah_rows = [row for m in members for row in standing_rows(m["evals"].get("niah", {}))]  # equal weights
        out.append({**members[0], "name": f"{_group_name(g)} ({len(members)} seeds)", "train": train,
                    "val": val, "train_std": train_std, "val_std": val_std,
                    "evals": {"ppl": {"rows": ppl_rows, "series_label": ppl_series(members[0]["evals"].get("ppl", {}))[1]},
                              "niah": {"rows": niah_rows}}})
    return out


def plot_all(records: list[dict], out_dir: Path) -> list[Path]:
    plt = _pyplot()
    from matplotlib import ticker

    colors = _colors(plt, len(records))
    written = []

    def after_step_0(record, key):  # validation from the first evaluation after step 0 (the untrained model)
        stds = record.get(f"{key}_std") or [None] * len(record[key])  # std: a seed group's spread
        points = [(step, v, sd) for (step, v), sd in zip(record[key], stds)]
        return [p for p in points if p[0] > 0] if key == "val" else points

    curves = [(r, c, after_step_0(r, "train"), after_step_0(r, "val")) for r, c in zip(records, colors)]
    if not any(train or val for _, _, train, val in curves):  # no curve to draw: no empty figure
        warn("no training or validation losses to plot: loss_curves.png not written")
        curves = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for record, color, *pair in curves:
        for ax, curve in zip(axes, pair):
            if curve:
                steps, values, stds = zip(*curve)
                ax.plot(steps, values, color=color, label=record["name"], marker="o" if len(curve) < 15 else None,
                        markersize=3)
                if stds[0] is not None:  # a seed group: mean +- std over its seeds
                    ax.fill_between(steps, [v - sd for v, sd in zip(values, stds)],
                                    [v + sd for v, sd in zip(values, stds)], color=color, alpha=0.2, linewidth=0)
    baselines = {round(b, 6) for b in (unigram_baseline(r) for r, *_ in curves) if b is not None}
    for baseline in sorted(baselines):  # the loss of predicting token frequencies alone
        for ax in axes:
            ax.axhline(baseline, color="gray", linestyle=":", linewidth=1,
                       label="unigram baseline" if len(baselines) == 1 else f"unigram {baseline:.3f}")
    band = " (shaded: ± 1 std over seeds)" if any(r.get("val_std") for r in records) else ""
    for ax, title in zip(axes if curves else [], ("Training loss", "Validation loss")):
        ax.set_title(title + band)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats per token)")
        ax.set_yscale("log")  # early losses are several times the final ones
        ax.yaxis.set_major_locator(ticker.MaxNLocator(8))
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%.3g"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    if curves:
        written.append(_save(fig, axes, out_dir / "loss_curves.png"))
    else:
        plt.close(fig)

    ppl = [(r, c, ppl_series(r["evals"].get("ppl", {}))) for r, c in zip(records, colors)]
    if any(rows for _, _, (rows, _) in ppl):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        styles, markers = ["-", "--", ":", "-."], ["o", "s", "^", "D"]
        windows = sorted({row.get("window") for _, _, (rows, _) in ppl for row in rows},
                         key=lambda w: (w is not None, w or 0))
        series = [(record, color, i, window, label, rows) for record, color, (rows, label) in ppl
                  for i, window in enumerate(windows) if any(row.get("window") == window for row in rows)]
        # every point at its own length; series that meet at one length stay visible as nested hollow markers,
        # the first series' largest (never shifted along the axis, which would misplace them)
        sizes = [max(3.0, 10.0 - 6.0 * k / max(1, len(series) - 1)) for k in range(len(series))]
        for k, (record, color, i, window, label, rows) in enumerate(series):
            points = sorted((row["length"], row["ppl"], row.get("ppl_std")) for row in rows if row.get("window") == window)
            name = record["name"] + (f" (window {window})" if window is not None else label.get(None, "")) \
                + label.get("data", "")
            lengths, values, stds = zip(*points)
            ax.plot(lengths, values, color=color, linestyle=styles[i % 4], marker=markers[i % 4],
                    markersize=sizes[k], fillstyle="none", markeredgewidth=1.5, label=name)
            if stds[0] is not None:  # a seed group: mean +- std over its seeds
                ax.fill_between(lengths, [v - sd for v, sd in zip(values, stds)],
                                [v + sd for v, sd in zip(values, stds)], color=color, alpha=0.2, linewidth=0)
        _log2_lengths(ax, [row["length"] for _, _, (rows, _) in ppl for row in rows])
        trained = sorted({r["config"].get("model", {}).get("block_size") for r, _, (rows, _) in ppl if rows} - {None})
        for i, length in enumerate(trained):  # where extrapolation begins
            ax.axvline(length, color="0.5", linestyle=":", linewidth=1,
                       label="training length" + (f"s ({', '.join(map(str, trained))})" if len(trained) > 1 else
                                                  f" ({length})") if i == 0 else None)
        ax.set_title("Perplexity vs evaluation length" + band)
        ax.set_xlabel("evaluation length (tokens)")
        ax.set_ylabel("perplexity")
        written.append(_save(fig, [ax], out_dir / "ppl_vs_length.png"))

    niah = [(r, c, standing_rows(r["evals"].get("niah", {}))) for r, c in zip(records, colors)]
    if any(rows for _, _, rows in niah):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        all_lengths = []
        for record, color, rows in niah:
            lengths = sorted({row["length"] for row in rows if _is_number(row.get("length"))})
            points = [(n, _weighted_mean([row for row in rows if row.get("length") == n and row.get("kind") != "average"],
                                          "acc_rank")) for n in lengths]
            points = [(n, v) for n, v in points if v is not None]
            if points:
                all_lengths += [n for n, _ in points]
                ax.plot(*zip(*points), color=color, marker="o",
                        label=record["name"] + standing_data(record["evals"].get("niah", {})))
        _log2_lengths(ax, all_lengths)
        ax.set_ylim(-0.02, 1.02)
        ax.set_title("Needle retrieval vs context length (rank accuracy, mean over depth and kind)")
        ax.title.set_fontsize(10)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("accuracy (acc_rank)")
        written.append(_save(fig, [ax], out_dir / "retrieval_vs_distance.png"))
    return written


# ---- paired comparison ------------------------------------------------------------------------------------

def _sort_key(value):
    return (0, value, "") if _is_number(value) else (1, 0, str(value))


def ppl_series(result: dict) -> tuple[list[dict], dict]:
    """A run's perplexity rows as plotted, and the labels of its series: the trained window's rows are the
    model as trained (one series, said once: "(as trained, window W)"), and results on other data than the run's
    own validation split are named ("data": " (data NAME)")."""
    rows = [row for row in standing_rows(result) if _is_number(row.get("length")) and _is_number(row.get("ppl"))]
    if "series_label" in result:  # a seed group's mean rows, already as plotted
        return rows, result["series_label"]
    trained = result.get("trained_window")
    plain = {row["length"] for row in rows if row.get("window") is None}
    rows = [{**row, "window": None} if trained is not None and row.get("window") == trained else row for row in rows
            if not (trained is not None and row.get("window") == trained and row["length"] in plain)]
    label = {}
    if trained is not None and any(row.get("window") is not None for row in rows):
        label[None] = f" (as trained, window {trained})"
    if standing_data(result):
        label["data"] = standing_data(result)
    return rows, label


def standing_data(result: dict) -> str:
    """" (data NAME)" when a task's standing setting was computed on other data than the run's own validation
    split, else ""."""
    data = data_label((result.get("settings") or {}).get(standing_setting(result)) or {})
    return f" ({data.replace('=', ' ')})" if data else ""


def standing_rows(result: dict) -> list[dict]:
    """The rows that stand for a task's result in plots: those of its standing setting (all rows of a result from
    before settings were recorded)."""
    return setting_items({"results": result}, "rows", standing_setting(result))


def paired(run_a: dict, run_b: dict, task: str, key: str = "correct", by: str | None = None,
           n_boot: int = 10000, seed: int = 0) -> dict:
    """Paired statistics of two run records on one task's per_example results (overall, and per value of by),
    under an evaluation setting both were evaluated with (the same examples)."""
    results = []
    for record in (run_a, run_b):
        result = record["evals"].get(task)
        if result is None:
            raise CompareError(f"{record['source']} has no eval/{task}.json (run: python -m eval "
                               f"--out_dir={record['source']} --tasks={task})")
        if not result.get("per_example"):
            raise CompareError(f"{result.get('path', record['source'])} has no per_example results to pair")
        results.append(result)
    # a setting both were evaluated under (the same examples), else each one's own, said; the example ids must
    # then still be the same on both sides
    shared = set(results[0].get("settings") or {}) & set(results[1].get("settings") or {})
    chosen = [standing_setting(r) for r in results]
    if shared:  # one setting on both sides: the one both were most recently evaluated under, on their own
        #         validation split and full ones first
        both = lambda sid: (all(own_data(r["settings"][sid]) for r in results),  # noqa: E731
                            not results[0]["settings"][sid].get("limit"),
                            min(r["settings"][sid].get("evaluated_at") or 0 for r in results))
        chosen = [max(sorted(shared), key=both)] * 2
        if len(shared) > 1:
            labels = describe_settings({sid: results[0]["settings"][sid] for sid in shared})
            warn(f"{run_a['name']} and {run_b['name']} share {len(shared)} evaluation settings on {task}; pairing "
                 f"under {labels[chosen[0]]} ({chosen[0]}), the one both were most recently evaluated under")
    elif all(r.get("settings") for r in results):
        a, b = (setting_options(r["settings"][sid]) for r, sid in zip(results, chosen))
        data = [r["settings"][sid].get("data") or {} for r, sid in zip(results, chosen)]
        if reads_validation_text(task, a) and all(d.get("val_sha256") for d in data) \
                and data[0]["val_sha256"] != data[1]["val_sha256"]:  # windows of different text never pair
            raise CompareError(f"{run_a['name']} and {run_b['name']} were evaluated on {task} on different text "
                               f"({data[0].get('name')}, {data[0].get('val_tokens'):,} validation tokens; "
                               f"{data[1].get('name')}, {data[1].get('val_tokens'):,}): their examples share ids but "
                               "not text, so pairing them would be meaningless; evaluate both with the same --data_dir")
        differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        warn(f"{run_a['name']} and {run_b['name']} were evaluated on {task} under different settings "
             f"({', '.join(differ)} differ): pairing their examples by id")
    examples = [[x for x in r["per_example"] if x.get("setting") == sid] for r, sid in zip(results, chosen)]
    cells = sorted({str(x.get("cell")) for x in examples[0] if x.get("cell") is not None}, key=_sort_key)
    # perplexity scores the same validation text once per cell (each length, each window): windows of several
    # cells are not independent units, so pooling them is no test; each cell is one
    overlapping = task == "ppl" and len(cells) > 1
    if overlapping and not by:
        by = "cell"
    try:
        out = {"task": task, "key": key, "a": {"name": run_a["name"], "source": run_a["source"],
                                               "provenance": run_a["evals"][task].get("provenance")},
               "b": {"name": run_b["name"], "source": run_b["source"],
                     "provenance": run_b["evals"][task].get("provenance")},
               "all": paired_comparison(*examples, key=key, n_boot=n_boot, seed=seed)}
        if overlapping:
            out["all"]["not_a_test"] = (f"the cells {', '.join(cells)} score the same text: their windows pooled are "
                                        "not independent, so this row is a description, not a test")
        if by:
            values = sorted({e.get(by) for e in examples[0]}, key=_sort_key)
            if None in values:
                raise CompareError(f"--by {by}: some per_example items of {run_a['source']} lack '{by}'")
            out["by"] = by
            out["groups"] = {str(v): paired_comparison([e for e in examples[0] if e.get(by) == v],
                                                       [e for e in examples[1] if e.get(by) == v],
                                                       key=key, n_boot=n_boot, seed=seed) for v in values}
    except ValueError as e:
        raise CompareError(f"{run_a['name']} vs {run_b['name']} on {task}: {e}") from None
    return out


def render_paired(result: dict) -> str:
    if result["all"].get("binary", True):
        headers = ["A", "B", "task", "subset", "n", "acc A", "acc B", "A only", "B only", "McNemar p", "A - B [95% CI]"]
    else:  # continuous values (e.g. per-window NLL): means, the sign test, the mean difference
        headers = ["A", "B", "task", "subset", "n", "mean A", "mean B", "A lower", "B lower", "sign test p",
                   "A - B [95% CI]"]
    digits = 3 if result["all"].get("binary", True) else 4  # losses differ in the third decimal
    items = [("all", result["all"])] + [(f"{result['by']}={k}", v) for k, v in result.get("groups", {}).items()]
    rows, notes = [], []
    for subset, r in items:
        bs = r["bootstrap"]
        level = round(100 * (1 - bs["alpha"]))
        headers[-1] = f"A - B [{level}% CI]"
        test = [format_p(r["mcnemar"]["p_value"]),
                f"{bs['diff']:+.{digits}f} [{bs['ci_low']:+.{digits}f}, {bs['ci_high']:+.{digits}f}]"]
        if r.get("not_a_test"):
            test = ["not a test ‡", f"{bs['diff']:+.{digits}f}"]
            notes.append(f"‡ {subset}: {r['not_a_test']}; the rows below, one cell each, are the tests")
        rows.append([result["a"]["name"], result["b"]["name"], result["task"], subset, str(r["n"]),
                     f"{r['acc_a']:.{digits}f}", f"{r['acc_b']:.{digits}f}", str(r["a_only"]), str(r["b_only"]), *test])
    table = markdown_table(headers, rows, right=set(range(4, len(headers))))
    return table + "".join(f"\n\n{note}" for note in notes)



# ---- NLL by window position -------------------------------------------------------------------------------

def position_gain(tables: dict, records: list[dict], reference: str, length: int | None = None,
                  block: int | None = None, bin_size: int = 16) -> dict:
    """Each seed group's NLL gain over the reference's group by position in the evaluation window (paper
    004's Fig. 5 on held-out text: where blocks lose context, just after a block boundary, is where a bridge
    should gain).

    The profiles are the ppl eval's mean NLL at each window position (eval/ppl.py) at `length` (default: the
    reference's training length) with the models as trained; a group's profile is the mean over its seeds.
    gain = reference NLL - group NLL (positive: better than the reference), reported in bins of `bin_size`
    over the whole window (`bins`) and by offset from the last block boundary at multiples of `block`
    (default: the reference's block_len) for the positions after the first block (`offsets`), each as
    mean +- sample std over the group's seeds.
    """
    by_name = {r["name"]: r for r in records}
    if reference not in by_name:
        raise CompareError(f"--position_gain {reference}: no such run (runs: {', '.join(sorted(by_name))})")
    model = by_name[reference]["config"].get("model", {})
    length = length or model.get("block_size")
    block = block or model.get("block_len")
    if not (isinstance(block, int) and block > 0 and isinstance(length, int) and length > block):
        raise CompareError(f"--position_gain needs a block length below the evaluation length (block {block}, "
                           f"length {length}): set --position_block and --position_length")

    def profile(record) -> np.ndarray:
        result = record["evals"].get("ppl", {})
        for entry in setting_items({"results": result}, "positions", standing_setting(result)):
            if entry.get("length") == length and entry.get("window") is None:
                return np.array([np.nan if v is None else v for v in entry["nll"]], dtype=np.float64)
        raise CompareError(f"{record['source']} has no NLL by position at L={length} (run: python -m eval "
                           f"--out_dir={record['source']} --tasks=ppl --ppl_lengths={length})")

    groups = {_group_name(g): [profile(by_name[n]) for n in g["runs"]] for g in tables["groups"]}
    ref_label = next(_group_name(g) for g in tables["groups"] if reference in g["runs"])
    ref_profile = np.nanmean(groups[ref_label], axis=0)
    positions = np.arange(length)
    offset_bins = list(range(0, block, bin_size))
    out = {"reference": ref_label, "length": length, "block": block, "bin": bin_size, "groups": {}}
    for label, profiles in groups.items():
        gains = [ref_profile - p for p in profiles]  # one per seed

        def summary(mask):
            values = [float(np.nanmean(g[mask])) for g in gains]
            return mean_std(values)

        out["groups"][label] = {
            "all": summary(positions >= block),
            "offsets": [summary((positions >= block) & (positions % block >= o) & (positions % block < o + bin_size))
                        for o in offset_bins],
            "bins": [summary((positions >= s) & (positions < s + bin_size)) for s in range(0, length, bin_size)]}
    out["offset_bins"] = offset_bins
    return out


def render_position_gain(result: dict) -> str:
    b, size = result["block"], result["bin"]
    headers = ["model", "all after the first block"] + [f"offset [{o}, {o + size})" for o in result["offset_bins"]]
    rows = [[label] + [f"{m:+.4f} ± {sd:.4f}" for m, sd in [g["all"], *g["offsets"]]]
            for label, g in result["groups"].items() if label != result["reference"]]
    return (f"NLL gain over {result['reference']} (nats per token, reference minus model: positive is better) at "
            f"L={result['length']}, by offset from the last block boundary (multiples of {b}), mean ± std over "
            f"seeds:\n\n" + markdown_table(headers, rows, right=set(range(1, len(headers)))))


def plot_position_gain(result: dict, out_dir: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    size = result["bin"]
    labels = [label for label in result["groups"] if label != result["reference"]]
    for label, color in zip(labels, _colors(plt, len(labels))):
        bins = result["groups"][label]["bins"]
        starts = [i * size for i in range(len(bins))]
        ax.errorbar(starts, [m for m, _ in bins], yerr=[sd for _, sd in bins], color=color, marker="o",
                    markersize=3, capsize=2, label=label)
    for boundary in range(result["block"], result["length"], result["block"]):
        ax.axvline(boundary, color="gray", linestyle="--", linewidth=0.8)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_title(f"NLL gain over {result['reference']} by window position ({size}-token bins; dashed: block "
                 f"boundaries)")
    ax.title.set_fontsize(9)
    ax.set_xlabel("position in the evaluation window (bin start)")
    ax.set_ylabel("reference NLL - model NLL")
    return _save(fig, [ax], out_dir / "position_gain.png")
