"""eval/TASK.json files: every cell a task computed for one model, each with the evaluation setting it was
computed under.

A call of python -m eval computes cells (a length, a window, a subtask, a probe) under one setting (the data,
--limit, the seed, the test-time window, the task's own options, a --hf model's attention settings). Its cells are
merged into the task's file: a cell computed again under the same setting is replaced (with everything derived
from it: its per-example results, its position profile, the subtask average at its length), and every other cell
is kept, so a quick --limit check never wipes a full evaluation and evaluating one more length never drops the
others. A file holds one model's cells: evaluating another checkpoint (another step, another run config) moves
the earlier file to eval/superseded/ first. Readers (the summary, scripts/compare.py, eval/bridge_tables.py)
take a task's result from standing_setting and label the others by what sets them apart.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from eval.niah import PROMPT_VERSION, average_rows


# a cell: what one call computes as a unit, and may compute for several values at once (lengths, windows,
# subtasks, probes); every row, per-example item and position profile of a task carries these keys
CELL_KEYS = {"ppl": ("length", "window"), "niah": ("kind", "length", "depth"), "recall": ("filler", "length"),
             "diagnostics": ("probe",)}
# options that define cells, or only how the work is done, rather than the numbers of a cell
NOT_SETTINGS = {"out_dir", "tasks", "device", "batch_size", "progress", "ppl_lengths", "ppl_windows", "niah_lengths",
                "niah_kinds", "niah_depths", "recall_lengths", "recall_filler", "diag_probes", "diag_distances"}
TASK_PREFIXES = {"ppl": "ppl_", "niah": "niah_", "recall": "recall_", "diagnostics": "diag_"}
ITEMS = ("rows", "positions", "per_example")


def evaluation_setting(task: str, e, data_dir, attention: dict | None = None) -> dict:
    """What besides a cell's coordinates decides its numbers for a given model: the data, the number of examples
    (--limit), the seed, the test-time window, the task's own options, a --hf model's attention settings. Two runs
    evaluated with the same options have the same setting, so their cells compare (and pair) with each other."""
    options = dataclasses.asdict(e)
    own = lambda key: not any(key.startswith(p) for p in TASK_PREFIXES.values()) or key.startswith(TASK_PREFIXES[task])  # noqa: E731
    setting = {key: value for key, value in options.items() if key not in NOT_SETTINGS and own(key)}
    setting["data_dir"] = os.path.realpath(str(data_dir))
    if task == "niah":  # RULER's exact prompts (version 2) are another setting than the earlier wording
        setting["niah_prompt_version"] = PROMPT_VERSION
    if attention:
        setting["attention"] = attention
    return setting


def setting_id(setting: dict) -> str:
    return hashlib.sha256(json.dumps(setting, sort_keys=True, default=str).encode()).hexdigest()[:10]


def evaluated_model(provenance: dict) -> dict:
    """Which model a call evaluated: the checkpoint's file name (the run folder may be named by another path,
    or moved), its step and its run config (a --hf model: its name; its attention settings are part of the
    setting)."""
    hf, ckpt = "attention" in provenance, provenance.get("ckpt")
    return {"ckpt": ckpt if hf or ckpt is None else Path(ckpt).name, "step": provenance.get("step"),
            "config_hash": None if hf else provenance.get("config_hash")}


def own_data(setting: dict) -> bool:
    """Whether a setting's cells were computed on the run's own validation split (settings recorded before the
    data was: assumed so, as they were shown)."""
    data = setting.get("data")
    return not isinstance(data, dict) or bool(data.get("own"))


def reads_validation_text(task: str, options: dict) -> bool:
    """Whether a task's examples are cut from the data's validation text (perplexity windows, the essay haystack,
    the diagnostics' filler) rather than generated from the seed alone (recall, a niah haystack of its own)."""
    return task in ("ppl", "diagnostics") or task == "niah" and options.get("niah_haystack", "val") == "val"


def data_label(setting: dict) -> str:
    """"" for the run's own validation split, else "data=NAME": how results on other data are labelled."""
    return "" if own_data(setting) else f"data={(setting.get('data') or {}).get('name', '?')}"


def standing_setting(report: dict, among=None):
    """The evaluation setting whose cells stand for a task's result: the most recently evaluated one on the run's
    own validation split over all examples (no --limit), else on its own split, else the most recent (a --hf
    model has no split of its own); among: only those settings. None for a result from before settings were
    recorded (its items carry none)."""
    settings = report.get("settings") or {}
    found = [sid for sid in settings if among is None or sid in among]
    rank = lambda sid: (own_data(settings[sid]), not settings[sid].get("limit"), _evaluated_at(settings[sid]))  # noqa: E731
    return max(found, key=rank, default=None)


def _evaluated_at(setting: dict) -> float:
    at = setting.get("evaluated_at")
    return at if isinstance(at, (int, float)) else 0.0  # older files: insertion order decides (max is stable)


def read_report(path: Path) -> dict:
    """A task's file, {} when there is none; one that cannot be read is kept aside (never overwritten)."""
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        kept = path.with_name(f"{path.name}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(path, kept)
        print(f"warning: {path} could not be read; kept as {kept.name}, results start afresh", file=sys.stderr)
        return {}


def supersede(path: Path, old: dict, model: dict) -> dict:
    """old, or {} after moving its file to eval/superseded/ when it holds another model's cells (a file holds one
    model's: cells of two checkpoints side by side would read as one model's results)."""
    before = old.get("model") or evaluated_model(old.get("provenance") or {})
    if before.get("config_hash") is not None and before.get("ckpt"):  # a file from when the whole path was kept
        before = {**before, "ckpt": Path(before["ckpt"]).name}
    if not old or before == model:
        return old
    folder = path.parent / "superseded"
    folder.mkdir(exist_ok=True)
    step = f"-step{before['step']}" if before.get("step") is not None else ""
    kept = folder / f"{path.stem}{step}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json"
    os.replace(path, kept)
    print(f"note: {path.name} held the results of {before['ckpt']}" + (f" at step {before['step']}" if step else "")
          + f"; another model is evaluated now, so they were moved to {kept}", file=sys.stderr)
    return {}


def merged_report(path: Path, task: str, result: dict, e, data_dir, provenance: dict) -> dict:
    """eval/TASK.json with this call's cells added: a cell computed before under the same setting is replaced
    (rows, per-example items and position profiles alike), every other cell (other lengths, other settings: a
    quick --limit check beside a full evaluation) is kept. Every item names its setting; the settings (with the
    provenance and time of the call that last computed under each, and their other results, such as the
    diagnostics' NLL profiles) are listed in "settings", most recent last."""
    model = evaluated_model(provenance)
    setting = evaluation_setting(task, e, data_dir, provenance.get("attention"))
    sid = setting_id(setting)
    result = dict(result)
    new = {key: list(result.pop(key, None) or []) for key in ITEMS}
    for items in new.values():
        for item in items:
            item["setting"] = sid
    old = supersede(path, read_report(path), model)
    old_settings = dict(old.get("settings") or {})
    legacy = None
    if old and not old_settings:  # written before settings were recorded: one setting, from its provenance
        legacy_options = (old.get("provenance") or {}).get("eval_config")
        legacy = "legacy"
        if isinstance(legacy_options, dict):
            known = {k: v for k, v in legacy_options.items() if k in dataclasses.asdict(e)}
            legacy = setting_id(evaluation_setting(task, dataclasses.replace(e, **known), data_dir,
                                                   (old.get("provenance") or {}).get("attention")))
        old_settings[legacy] = {"provenance": old.get("provenance"),
                                "results": {k: v for k, v in (old.get("results") or {}).items() if k not in ITEMS}}
    keys = CELL_KEYS.get(task, ())
    cell = lambda item: (item.get("setting", legacy), *(json.dumps(item.get(k)) for k in keys))  # noqa: E731
    replaced = {cell(item) for items in new.values() for item in items}
    # an example id names one example of a setting: never two items with it (pairing joins on it), whatever
    # cell keys an older file's items lack
    replaced_ids = {(sid, item.get("id")) for item in new["per_example"]}
    gone = lambda item: cell(item) in replaced or (item.get("setting", legacy), item.get("id")) in replaced_ids  # noqa: E731
    old_items = {**(old.get("results") or {}), "per_example": old.get("per_example") or []}
    merged = {}
    for key in ITEMS:
        kept = [dict(item) for item in old_items.get(key) or [] if not gone(item)]
        for item in kept:
            item.setdefault("setting", legacy)
        merged[key] = kept + new[key]
    if task == "niah":  # the subtask averages of this setting, over its cells as merged
        rows = [r for r in merged["rows"] if not (r.get("setting") == sid and r.get("kind") == "average")]
        merged["rows"] = rows + [{**r, "setting": sid} for r in average_rows([r for r in rows if r["setting"] == sid])]
    # results besides the items (the diagnostics' NLL profiles, the trained window): per setting; one this call
    # did not compute (a probe it did not run) keeps the earlier value
    earlier = (old_settings.pop(sid, None) or {}).get("results") or {}
    computed = {k: v for k, v in result.items() if v not in (None, [], {})}
    own_results = {**earlier, **{k: v for k, v in result.items() if k not in earlier}, **computed}
    settings = {**old_settings, sid: {**setting, "provenance": provenance, "evaluated_at": time.time(),
                                      "results": own_results,
                                      **({"data": provenance["data"]} if provenance.get("data") else {})}}
    report = {"task": task, "model": model, "results": {**own_results, "rows": merged["rows"]},
              "provenance": provenance, "settings": settings}
    if merged["positions"]:
        report["results"]["positions"] = merged["positions"]
    if merged["per_example"]:
        report["per_example"] = merged["per_example"]
    return report


def setting_options(setting: dict) -> dict:
    """A setting's options, without the record of its evaluation (provenance, time, results)."""
    return {k: v for k, v in setting.items() if k not in ("provenance", "evaluated_at", "results", "data")}


def setting_items(report: dict, key: str, sid) -> list[dict]:
    """A setting's rows, positions or per_example items of a task's file."""
    items = report.get("per_example") if key == "per_example" else (report.get("results") or {}).get(key)
    return [item for item in items or [] if sid is None or item.get("setting") == sid]


def setting_results(report: dict, sid) -> dict:
    """A setting's results besides its items (a file from before they were kept per setting: the file's)."""
    own = ((report.get("settings") or {}).get(sid) or {}).get("results")
    return own if own is not None else {k: v for k, v in (report.get("results") or {}).items() if k not in ITEMS}


def describe_settings(settings: dict) -> dict:
    """{setting id: a label}: what sets each setting apart from the task's others (with one setting, whether its
    cells were computed on a --limit'ed number of examples)."""
    options = {sid: setting_options(s) for sid, s in settings.items()}
    keys = sorted({k for o in options.values() for k in o})
    differing = [k for k in keys if len({json.dumps(o.get(k), default=str) for o in options.values()}) > 1]
    labels = {}
    for sid, o in options.items():
        parts = [f"{k}={o.get(k)}" for k in differing if k != "data_dir"]
        if "data_dir" in differing:  # the data by name, and whether it is the run's own validation split
            parts.insert(0, data_label(settings[sid]) or "own data")
        elif data_label(settings[sid]):
            parts.insert(0, data_label(settings[sid]))
        if o.get("limit") and "limit" not in differing:
            parts.insert(0, f"limit={o['limit']}")
        labels[sid] = ", ".join(parts) or ("all examples" if not o.get("limit") else f"limit={o['limit']}")
    return labels


