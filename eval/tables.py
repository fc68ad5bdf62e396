"""The table of runs and its seed groups: the config keys that tell runs apart, the values derived from a record
(parameters, tokens seen), build_tables, and the markdown the command line prints."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
from types import SimpleNamespace

import torch

from attention.registry import mixer_settings, used_settings
from config import Config
from eval.compare import is_number, warn
from eval.ppl import MIN_WINDOWS
from eval.stats import mean_std
from eval.summaries import eval_flags, eval_summaries
from model import GPT
from common import outputs

# config keys that name or log a run without changing what it computes
IGNORED_KEYS = {"out_dir", "wandb_run_name", "wandb_project", "wandb_log", "wandb_mode", "wandb_group", "wandb_tags", "init_from", "data.created",
                "data_meta.created"}  # data.created: the meta's, in runs written before data_meta
IGNORED_GROUPS = {"run", "provenance", "n_params", "invocations", "resolved"}
SEED_KEY = "seed"
FIXED_COLUMNS = ["params", "tokens", "best val loss", "final train loss", "tokens/s", "MFU", "wall time"]


def _flatten(values: dict, prefix: str, out: dict) -> None:
    for key, value in values.items():
        if isinstance(value, dict):
            _flatten(value, f"{prefix}{key}.", out)
        else:
            out[f"{prefix}{key}"] = tuple(value) if isinstance(value, list) else value


def _defaults() -> dict:
    # every field, the settings of every variant among them (to_dict keeps only those of the default pattern's
    # mixers): a run saved before a setting its mixer reads existed shows that setting's default
    return dataclasses.asdict(Config())


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
    """Parameters of the run's model, built on the meta device (no memory, no init); None, with a warning, if this
    version cannot build it from the saved settings (a mixer or a value of another version: the ValueError or
    TypeError the config's checks raise). vocab_size comes from the model config, or (when 0) from the data meta
    padded to a multiple of 64."""
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
            with contextlib.redirect_stderr(io.StringIO()):  # from_dict warns about keys of other versions
                cfg = Config.from_dict({"model": model_cfg})
            cfg.model.vocab_size = vocab if model_cfg.get("vocab_size") else -(-vocab // 64) * 64
            with torch.device("meta"):
                _PARAMS_CACHE[key] = GPT(cfg.model).num_params()
        except (ValueError, TypeError) as e:  # ConfigError is a ValueError
            warn(f"cannot build the model of attn_pattern={model_cfg.get('attn_pattern', 'full')!r} to count its "
                 f"parameters ({e}); its params show as -")
            _PARAMS_CACHE[key] = None
    return _PARAMS_CACHE[key]


def tokens_seen(record: dict, flat: dict) -> int | None:
    """last training step x batch_size x gradient_accumulation_steps x block_size (global batch: DDP divides
    gradient_accumulation_steps among processes)."""
    step = record["last_train_step"]
    factors = [flat.get(k) for k in ("batch_size", "gradient_accumulation_steps", "block_size")]
    if step is None or not all(is_number(f) for f in factors):
        return None
    return int(step * factors[0] * factors[1] * factors[2])


def _group_label(flat: dict, keys: list[str]) -> str:
    return ", ".join(f"{k}={_fmt_config(flat.get(k, MISSING))}" for k in keys) or "all"


def group_name(group: dict) -> str:
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
            values = [m["cells"][col] for m in members if is_number(m["cells"].get(col))]
            if values:
                mean, std = mean_std(values)
                g["stats"][col] = (mean, std, len(values))
    return {"diff_keys": diff_keys, "group_keys": group_keys, "columns": numeric_cols, "rows": rows,
            "groups": list(groups.values())}


# ---- formatting -------------------------------------------------------------------------------------------

def fmt_value(column: str, value) -> str:
    if not is_number(value):
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
