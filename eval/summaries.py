"""Each evaluation result's headline numbers: one value per task, metric, length (and window), as the runs table's
columns and as the keys python -m eval writes into a run's wandb summary."""

from __future__ import annotations

from pathlib import Path

from eval.compare import is_number
from eval.records import load_evals
from eval.results import data_label, standing_setting

# eval row fields that identify a row even when numeric, and counts that weight it (never metrics)
ROW_ID_KEYS = {"kind", "length", "window", "depth", "task", "name", "split", "subset"}
ROW_COUNT_KEYS = {"n", "tokens", "count", "total", "n_examples"}


def weighted_mean(rows: list[dict], metric: str) -> float | None:
    """Mean of a metric over rows, weighted by each row's n when rows have one (rows with n = 0 drop out)."""
    pairs = [(r[metric], r["n"] if is_number(r.get("n")) else 1) for r in rows if is_number(r.get(metric))]
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
        elif is_number(value):
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
                if r.get("few_windows") and is_number(r.get("ppl")) and is_number(r.get("length")):
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
            if is_number(r.get("ppl")) and is_number(r.get("length")):
                w = None if r.get("window") == trained else r.get("window")
                out[ppl_column(r, trained)] = ((task, "ppl", -1 if w is None else w, r["length"]), float(r["ppl"]))
        return out
    metrics = ["score", "acc_rank"] if task == "niah" else sorted({m for r in rows for m in _row_fields(r)[1]})
    label = {"score": "niah", "acc_rank": "niah_rank"} if task == "niah" else {}
    for metric in metrics:
        prefix = label.get(metric, f"{task}_{metric}")
        lengths = sorted({r["length"] for r in rows if is_number(r.get("length")) and metric in r})
        if lengths:
            for length in lengths:
                at_length = [r for r in rows if r.get("length") == length]
                averaged = [r for r in at_length if r.get("kind") == "average"]
                value = weighted_mean(averaged or at_length, metric)
                if value is not None:
                    out[f"{prefix}@L={length}"] = ((task, metric, -1, length), value)
        else:
            value = weighted_mean(rows, metric)
            if value is not None:
                out[prefix] = ((task, metric, -1, -1), value)
    return out


def evaluation_summary(out_dir, tasks) -> dict:
    """{"eval/<task>/<column>": value}: each task's headline numbers as eval_summaries gives them (ppl per
    length and window, niah's RULER score and rank accuracy per length, other tasks' metrics per length or overall).
    Results on other data than the run's own validation split, or on --limit'ed examples, carry the label the
    comparison gives them in the key ("ppl@L=1024 (data essay)"): never the run's own numbers."""
    evals = load_evals(Path(out_dir))
    values = {}
    for task in tasks:
        if task in evals:
            for column, (_, value) in eval_summaries({task: evals[task]}).items():
                values[f"eval/{task}/{column}"] = value
    return values
