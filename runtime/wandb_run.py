"""A run's wandb run: how it is named (group, tags), what its config holds, its x-axis (tokens seen), the record
of it in the run folder (wandb.json), and evaluation results written back into it.

    run = start_run(cfg, out_dir, argv, mode, run_id=None, run=info, n_params=n)   # train.py, rank 0
    report_evaluation(out_dir, {"eval/ppl/ppl@L=1024": 21.3, ...})                 # python -m eval

Runs are grouped by their recipe and scale and tagged with their variants and the papers those come from, so a
project's runs can be filtered and grouped without naming each one; every row carries tokens_seen, the x-axis that
lines up runs trained with different tokens per step; the config holds only the settings the run's layers read.
The run folder's wandb.json names the wandb run (id, project, mode), so that python -m eval can resume it by id and
write its results into the run's summary, next to the training curves.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

from attention.registry import MIXERS, pattern_names
from config import MAX_GROUP, split_tags
from common.outputs import write_json

REPO = Path(__file__).resolve().parent.parent
RECORD = "wandb.json"  # in the run folder: the wandb run's id, project, mode, group and tags
X_AXIS = "tokens_seen"


def package_problem() -> str:
    """Why wandb cannot be used here at all ("" when it can): the package is not installed."""
    if importlib.util.find_spec("wandb") is None:
        return f"the wandb package is not installed for {sys.executable} (pip install wandb)"
    return ""


def wandb_problem(mode: str) -> str:
    """Why an online wandb run cannot start here ("" when it can): no login, or no route to the server."""
    import netrc
    import socket
    from urllib.parse import urlparse

    if mode != "online":
        return ""
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    if not os.environ.get("WANDB_API_KEY"):
        try:
            logged_in = netrc.netrc().authenticators(host) is not None
        except (OSError, netrc.NetrcParseError):
            logged_in = False
        if not logged_in:
            return f"no wandb login (no WANDB_API_KEY, no {host} entry in ~/.netrc)"
    try:
        socket.create_connection((host, 443), timeout=5).close()
    except OSError as e:
        return f"{host} cannot be reached ({e.strerror or e})"
    return ""


def resolved_mode(mode: str) -> str:
    """The mode a run logs in: WANDB_MODE=offline (or disabled) in the environment overrides an online setting, as
    wandb itself would, so a run meant for the server stays on the disk of a machine without the network."""
    env = os.environ.get("WANDB_MODE")
    if mode == "online" and env in ("offline", "disabled", "dryrun"):
        return "offline" if env == "dryrun" else env
    return mode


# ---- how a run is named ----------------------------------------------------------------------------------------

def recipe_folder(argv) -> str:
    """The paper's folder of configs/ that the run's config file comes from ("bridges" for
    configs/bridges/owt_124m_pbb.py), "" for a config file elsewhere (configs/quickstart.py, a run's config.json)."""
    configs = REPO / "configs"
    for arg in argv:
        if arg.startswith("-") or not arg.endswith(".py"):
            continue
        path = Path(arg) if os.path.exists(arg) else REPO / arg  # config.py looks files up the same way
        try:
            parts = path.resolve().relative_to(configs).parts
        except ValueError:
            continue
        if len(parts) > 1:
            return parts[0]
    return ""


def default_group(cfg, argv) -> str:
    """Runs that are compared with each other: the recipe folder, the data and the model's size
    ("bridges-openwebtext_gpt2-12x768", "embedded_byte-4x128"): the variants and seeds of one experiment."""
    data = Path(cfg.data.data_dir).name if cfg.data.data_dir else cfg.data.dataset
    parts = [recipe_folder(argv), data, f"{cfg.model.n_layer}x{cfg.model.n_embd}"]
    return "-".join(part for part in parts if part)[:MAX_GROUP]


def pattern_papers(attn_pattern: str) -> list[str]:
    """The papers (000 ... 004) a layer pattern comes from, as the registry's mixers say (Mixer.paper): the papers
    every one of its variants belongs to (swa,mlstm: 003, though swa alone is in 001, 002 and 003), else any of them."""
    sets = [set(re.findall(r"\b\d{3}\b", MIXERS[name].paper)) for name in dict.fromkeys(pattern_names(attn_pattern))
            if name in MIXERS]
    sets = [papers for papers in sets if papers]  # full attention belongs to no paper in particular
    if not sets:
        return []
    return sorted(set.intersection(*sets) or set.union(*sets))


def default_tags(attn_pattern: str) -> list[str]:
    """The variants of a pattern as written and as its layers run them (swax: swax, swa, mlstm), and its papers."""
    written = [name.strip() for name in attn_pattern.split(",")]
    return list(dict.fromkeys([*written, *pattern_names(attn_pattern)])) + \
        [f"paper-{paper}" for paper in pattern_papers(attn_pattern)]


def run_tags(cfg, recorded: list[str] | None = None) -> list[str]:
    """The run's tags: wandb_tags when given (a leading + adds them to the derived ones), else those recorded when
    the run started (a resumed run keeps its tags), else the pattern's variants and papers."""
    given = cfg.train.wandb_tags.strip()
    base = recorded if recorded is not None else default_tags(cfg.model.attn_pattern)
    if not given:
        return list(base)
    if given.startswith("+"):
        return list(dict.fromkeys([*base, *split_tags(given)]))
    return list(dict.fromkeys(split_tags(given)))


def run_config(cfg, **extra) -> dict:
    """The config as wandb keeps it: config.json's groups (Config.to_dict: the model's variant settings limited to
    those its layers read, a swa run's swa_window and no moba_block), so the runs table's columns mean something for
    every run; scripts/compare.py reads it as it reads config.json."""
    return {**cfg.to_dict(), **extra}


# ---- the run folder's record ---------------------------------------------------------------------------------

def read_record(out_dir) -> dict | None:
    """The wandb run a run folder logged to: wandb.json, or for runs trained before that file was written, the
    newest wandb/ folder that wandb made there (its name ends with the run id) with the project of config.json.
    None when the run did not log to wandb."""
    out_dir = Path(out_dir)
    try:
        record = json.loads((out_dir / RECORD).read_text())
        if isinstance(record, dict) and record.get("id"):
            return record
    except (OSError, ValueError):
        pass
    made = []  # (start time, run id, offline) of each folder wandb made: [offline-]run-YYYYMMDD_HHMMSS-ID
    for path in (out_dir / "wandb").glob("*run-*"):
        found = re.fullmatch(r"(offline-)?run-(\d{8}_\d{6})-(\w+)", path.name)
        if found and path.is_dir():
            made.append((found.group(2), found.group(3), bool(found.group(1))))
    if not made:
        return None
    _, run_id, offline = max(made)
    try:
        train = json.loads((out_dir / "config.json").read_text()).get("train", {})
    except (OSError, ValueError, AttributeError):
        train = {}
    return {"id": run_id, "project": train.get("wandb_project") or None, "mode": "offline" if offline else "online"}


def start_run(cfg, out_dir: Path, argv, mode: str, run_id: str | None = None, resuming: bool = False, **extra):
    """wandb.init for a training run (rank 0): a resumed run continues its wandb run (the checkpoint's id, else the
    folder's record) with the group and tags it started with unless wandb_group / wandb_tags say otherwise; rows
    are plotted against tokens_seen. Writes the folder's wandb.json (an OSError says the folder cannot be written)."""
    import wandb  # optional, and slow to import: only a run that logs to wandb needs it

    t = cfg.train
    recorded = (read_record(out_dir) or {}) if resuming else {}
    run_id = run_id or recorded.get("id")
    group = t.wandb_group or recorded.get("group") or default_group(cfg, argv)
    tags = run_tags(cfg, recorded.get("tags"))
    name = t.wandb_run_name or recorded.get("name") or out_dir.name
    run = wandb.init(project=t.wandb_project, name=name, group=group, tags=tags, config=run_config(cfg, **extra),
                     id=run_id, resume="allow", dir=str(out_dir), mode=mode)
    # the x-axis of every metric: runs of 2,048 and 4,096 tokens per step line up by the tokens they have seen
    # (the step stays wandb's own _step, the key scripts/compare.py reads curves by)
    run.define_metric(X_AXIS)
    run.define_metric("*", step_metric=X_AXIS)
    write_json({"id": run.id, "project": t.wandb_project, "entity": getattr(run, "entity", "") or "", "name": name,
                "group": group, "tags": tags, "mode": mode}, out_dir / RECORD)
    return run


# ---- evaluation results ------------------------------------------------------------------------------------------

def note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr)


def report_evaluation(out_dir, values: dict) -> None:
    """Write evaluation results, {"eval/<task>/<column>": value} (eval/summaries.py's evaluation_summary), into the
    summary of the wandb run the run folder logged to, resumed by id, in the mode it trained in (an online run that
    cannot be reached now: an offline copy to sync). Nothing for a run that did not log to wandb; a note, and the
    local results only, when wandb cannot be used."""
    out_dir = Path(out_dir)
    record = read_record(out_dir)
    if record is None:
        return
    mode = resolved_mode(record.get("mode") or "online")
    if not values or mode == "disabled":
        return
    skip = "(--wandb=False leaves wandb out)"
    problem = package_problem()
    if problem:
        note(f"{out_dir} logged to wandb run {record['id']}, but {problem}: its results are in {out_dir / 'eval'} "
             f"only; install wandb and evaluate again to add them to the run {skip}")
        return
    problem = wandb_problem(mode)
    if problem:
        note(f"wandb is not reachable ({problem}): the results go to an offline copy of run {record['id']} instead")
        mode = "offline"
    import wandb  # optional: imported once package_problem has found it installed

    try:
        run = wandb.init(id=record["id"], project=record.get("project") or None, entity=record.get("entity") or None,
                         name=record.get("name"), group=record.get("group"), tags=record.get("tags"),
                         resume="must", dir=str(out_dir), mode=mode,
                         # the training run's console log, system charts and environment are its own: an evaluation
                         # (perhaps on another machine) adds numbers only
                         settings=wandb.Settings(console="off", x_disable_stats=True, x_disable_meta=True,
                                                 x_save_requirements=False, quiet=True))
        run.summary.update(values)
        folder = Path(run.dir).parent  # wandb/offline-run-TIME-ID/files -> the run's folder
        run.finish()
    except Exception as e:  # wandb raises many kinds (a run id the server does not know, a timeout, ...)
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        note(f"could not write the results to wandb run {record['id']} ({type(e).__name__}: {reason}); they are in "
             f"{out_dir / 'eval'} {skip}")
        return
    where = (f"project {record.get('project')}" if mode == "online" else
             f"offline, in {folder}; `wandb sync {out_dir / 'wandb'}` uploads it after the training run's own")
    written = ", ".join(dict.fromkeys(key.split("/")[1] for key in values))
    print(f"wandb: {len(values)} results of {written} written to the summary of run {record['id']} ({where})")
