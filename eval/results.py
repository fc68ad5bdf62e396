"""eval/TASK.json files: every cell a task computed, each with the evaluation setting it was computed under.

A call of python -m eval computes cells (a length, a window, a subtask, a probe) under one setting (the data,
the checkpoint, --limit, the seed, the task's own options). Its cells are merged into the task's file: a cell
computed again under the same setting is replaced, and every other cell is kept, so a quick --limit check never
wipes a full evaluation and evaluating one more length never drops the others. Readers (the summary,
scripts/compare.py) label cells by what sets their setting apart.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path


# a row's cell: what one call may compute for several values at once (lengths, windows, subtasks, probes)
CELL_KEYS = {"ppl": ("length", "window"), "niah": ("kind", "length", "depth"), "recall": ("filler", "length"),
             "diagnostics": ("probe", "cell")}
# options that define cells, or only how the work is done, rather than the numbers of a cell
NOT_SETTINGS = {"out_dir", "tasks", "device", "batch_size", "progress", "ppl_lengths", "ppl_windows", "niah_lengths",
                "niah_kinds", "niah_depths", "recall_lengths", "recall_filler", "diag_probes", "diag_distances"}
TASK_PREFIXES = {"ppl": "ppl_", "niah": "niah_", "recall": "recall_", "diagnostics": "diag_"}


def evaluation_setting(task: str, e, data_dir) -> dict:
    """What besides a cell's coordinates decides its numbers: the data, the checkpoint, the number of examples
    (--limit), the seed, the test-time window, the task's own options. Two runs evaluated with the same
    options have the same setting, so their cells compare (and pair) with each other."""
    options = dataclasses.asdict(e)
    own = lambda key: not any(key.startswith(p) for p in TASK_PREFIXES.values()) or key.startswith(TASK_PREFIXES[task])  # noqa: E731
    setting = {key: value for key, value in options.items() if key not in NOT_SETTINGS and own(key)}
    setting["data_dir"] = os.path.realpath(str(data_dir))
    return setting


def setting_id(setting: dict) -> str:
    return hashlib.sha256(json.dumps(setting, sort_keys=True, default=str).encode()).hexdigest()[:10]


def merged_report(path: Path, task: str, result: dict, e, data_dir, provenance: dict) -> dict:
    """eval/TASK.json with this call's cells added: a cell computed before under the same setting and at the same
    coordinates is replaced, every other cell (other lengths, other settings: a quick --limit check beside a
    full evaluation) is kept. Every row, per-example item and position profile names its setting; the
    settings (and the provenance of the call that last computed under each) are listed in "settings"."""
    setting = evaluation_setting(task, e, data_dir)
    sid = setting_id(setting)
    per_example = result.pop("per_example", None)
    new = {"rows": result.get("rows", []), "per_example": per_example or [], "positions": result.get("positions", [])}
    for items in new.values():
        for item in items:
            item["setting"] = sid
    old = {}
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            kept = path.with_name(f"{path.name}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}")
            os.replace(path, kept)
            print(f"warning: {path} could not be read; kept as {kept.name}, results start afresh", file=sys.stderr)
            old = {}
    old_settings = dict(old.get("settings") or {})
    legacy = None
    if old and not old_settings:  # written before settings were recorded: one setting, from its provenance
        legacy_options = (old.get("provenance") or {}).get("eval_config")
        legacy = "legacy"
        if isinstance(legacy_options, dict):
            known = {k: v for k, v in legacy_options.items() if k in dataclasses.asdict(e)}
            legacy = setting_id(evaluation_setting(task, dataclasses.replace(e, **known), data_dir))
        old_settings[legacy] = {"provenance": old.get("provenance")}
    cell = lambda row: (row.get("setting", legacy), *(json.dumps(row.get(k)) for k in CELL_KEYS.get(task, ())))  # noqa: E731
    replaced = {cell(row) for row in new["rows"]}
    replaced_cells = {(sid, item.get("cell")) for item in new["per_example"]}
    old_results = old.get("results") or {}
    rows = [r for r in old_results.get("rows", []) if cell(r) not in replaced] + new["rows"]
    positions = [p for p in old_results.get("positions") or [] if cell(p) not in replaced] + new["positions"]
    per_example = [x for x in old.get("per_example") or [] if (x.get("setting", legacy), x.get("cell"))
                   not in replaced_cells] + new["per_example"]
    for items in (rows, positions, per_example):
        for item in items:
            item.setdefault("setting", legacy)
    report = {"task": task, "results": {**result, "rows": rows}, "provenance": provenance,
              "settings": {**old_settings, sid: {**setting, "provenance": provenance}}}
    if "positions" in result or positions:
        report["results"]["positions"] = positions
    if per_example:
        report["per_example"] = per_example
    return report


def describe_settings(settings: dict) -> dict:
    """{setting id: a label}: what sets each setting apart from the task's others (with one setting, whether its
    cells were computed on a --limit'ed number of examples)."""
    options = {sid: {k: v for k, v in s.items() if k != "provenance"} for sid, s in settings.items()}
    keys = sorted({k for o in options.values() for k in o})
    differing = [k for k in keys if len({json.dumps(o.get(k), default=str) for o in options.values()}) > 1]
    labels = {}
    for sid, o in options.items():
        parts = [f"{k}={o.get(k)}" for k in differing]
        if o.get("limit") and "limit" not in differing:
            parts.insert(0, f"limit={o['limit']}")
        labels[sid] = ", ".join(parts) or ("all examples" if not o.get("limit") else f"limit={o['limit']}")
    return labels


