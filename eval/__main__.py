"""Evaluate a trained run: writes OUT_DIR/eval/<task>.json and OUT_DIR/eval/summary.md.

    python -m eval --out_dir=out/quickstart --tasks=ppl,niah
    python -m eval --out_dir=out/swat --tasks=ppl --ppl_lengths=128,512,2048,8192 --ppl_windows=128,512 --ppl_stream=True
    python -m eval --out_dir=out/quickstart --tasks=niah --niah_lengths=256 --niah_kinds=single,multikey --niah_samples=20
    python -m eval --hf=Qwen/Qwen3-8B --attn_pattern=sa --swa_window=128 --data_dir=data/wikitext2_qwen3 --tasks=ppl

--hf=NAME_OR_PATH evaluates a Hugging Face causal LM instead of a run, with a variant in its attention layers
(attention/hf.py): any attention key of the model config (--attn_pattern, --swa_window, --block_len,
--bridge_width, --moba_block, ...) sets it, --hf_decode=full|variant says how generation decodes, and the
text of --data_dir must be prepared with the model's tokenizer (python -m data.prepare --tokenizer=NAME_OR_PATH).
Results go to --out_dir (default out/hf_<model>_<pattern>).

Tasks:
    ppl   perplexity of the validation split at each of ppl_lengths, and for window variants at each of
          ppl_windows (the model config field named by window_key, swa_window by default, is set to each);
          by document, or with ppl_stream as one stream (paper 001's long evaluation lengths)
    niah  RULER-style needle-in-a-haystack retrieval (eval/niah.py), scored by generation and by ranking
    recall  associative recall over a distance (eval/recall.py) for runs trained on --dataset=recall
    diagnostics  paper 004's boundary diagnostics (eval/diagnostics.py): needle by distance, bridge window,
          boundary sweep and tail, semantic exact / paraphrase / distractor / boundary, prompt NLL by position
Every JSON carries the command, git hash, config hash, checkpoint step and seed that produced it. A run trained
with --wandb_log=True also gets each task's headline numbers in its wandb run's summary (eval/<task>/<column>,
the run resumed by id; runtime/wandb_run.py); --wandb=False leaves wandb out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common import machine  # first: OpenMP's wait policy is read once, when torch loads it

machine.passive_openmp()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from attention import simulate_cuda
from attention.registry import SETTINGS, used_settings, validate_config
from attention.stochastic import drawn_per_forward
from config import (Config, ConfigError, ModelConfig, apply_args, coerce, dataclass_fields, exit_on_config_error,
                    resolve_device, unread_settings_problem)
from data.embedded import documents
from data.meta import DataError, load_meta, open_tokens, split_fingerprint, tokenizer_identity, tokenizer_mismatch
from data.tokenizer import TokenizerUnavailable
from eval import diagnostics as diagnostics_task
from eval import niah as niah_task
from eval import ppl as ppl_task
from eval import recall as recall_task
from eval.hf_model import load_pretrained_lm
from eval.results import describe_settings, merged_report
from eval.summaries import evaluation_summary
from model import GPT
from runtime.checkpoint import (CheckpointError, checkpoint_path, checkpoint_tokenizer_identity, describe_checkpoint,
                                git_hash, load_model, run_tokenizer)
from common.outputs import atomic_write, write_json
from runtime.pretrained import PretrainedError
from common.run_folder import held, holds_run, on_current_data, read_metrics, writable_folder_problem
from runtime.wandb_run import read_record, report_evaluation

REPO = Path(__file__).resolve().parent.parent


@dataclass
class EvalRunConfig:
    out_dir: str = ""
    tasks: str = "ppl"
    ckpt: str = "best"  # best | last
    device: str = "auto"
    dtype: str = "auto"  # auto: bfloat16 on capable GPUs, float32 otherwise
    batch_size: int = 8
    seed: int = 1337
    limit: int = 0  # quick checks: at most this many windows per ppl cell and examples per niah cell (0: all)
    # processes per window (context parallelism, docs/context_parallel.md): under torchrun with as many processes,
    # each window of the ppl task cut into that many shards, for lengths one process cannot hold
    context_parallel: int = 1
    data_dir: str = ""  # default: the run's own prepared data
    # ppl
    ppl_lengths: str = ""  # comma-separated; default: the run's block_size
    ppl_windows: str = ""  # comma-separated values for window_key; default: the trained window only
    window_key: str = "swa_window"
    window: int = 0  # every task with window_key set to this (a test-time window, paper 003); 0: as trained
    ppl_max_tokens: int = 200_000  # validation tokens scored per (length, window)
    ppl_stream: bool = False  # score the validation text as one stream (documents back to back, as training
    #                           windows see them) instead of document by document: lengths beyond the documents
    # niah
    niah_lengths: str = ""  # default: the run's block_size
    niah_depths: str = ""  # e.g. 0,0.25,0.5,0.75,1: the asked needle at each depth; "": RULER's random depths
    niah_kinds: str = ",".join(niah_task.KINDS)  # RULER's subtasks (eval/niah.py)
    niah_samples: int = 10
    niah_candidates: int = 4  # the ranking score: each expected value against candidates - 1 others
    niah_digits: int = 7  # RULER's 7-digit numbers
    niah_gen_tokens: int = niah_task.GEN_TOKENS  # tokens generated for the answer (RULER: 128), within the length
    # recall
    recall_lengths: str = ""  # default: the run's block_size
    recall_samples: int = 500
    recall_pairs: int = 1  # key-value pairs per document, as in data/recall.py (1 for the training corpus)
    recall_filler: str = ""  # comma-separated "MIN:MAX" filler digits between the pairs and the question
    #                          (default 60:80, as trained); longer filler asks for values further back
    niah_haystack: str = "val"  # essay haystack: val (the run's validation text) | embedded | PATH (a text file)
    # diagnostics (paper 004): the geometry must be the same for every run compared (pairing is by example)
    diag_probes: str = ""  # default: every probe the format has
    diag_format: str = "auto"  # notes | recall; auto: recall for runs trained on a recall corpus, else notes
    diag_samples: int = 0  # examples per cell (distance, offset); 0: the paper's prompts per probe (1,600 needle, 400 bridge window, ...)
    diag_distances: str = "16,32,48,64,96,128,192,256,384,512,768"  # needle and semantic distances (< length)
    diag_length: int = 0  # context length; 0: the run's block_size
    diag_block: int = 0  # block size b of the boundaries; 0: the run's block_len (a run without one must say)
    diag_half: int = 0  # bridge half-width h; 0: the run's bridge_width / 2 (se_bridge: its extension; else b / 2)
    progress: bool = True
    # a Hugging Face causal LM instead of a run (the attention settings are model config keys on the command line)
    hf: str = ""  # hub name or save_pretrained folder
    hf_dtype: str = ""  # the weights' dtype (float32, bfloat16, float16); default: --dtype's
    hf_decode: str = "full"  # full: the variant in the prompt's forward only (paper 000) | variant: also decoding
    hf_context: int = 2048  # the evaluation length the tasks default to (their *_lengths, diag_length)
    hf_tokenizer: str = ""  # default: the model's own (tokenizer.json of the folder or hub repository)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# model settings a run may be evaluated under: the variants' inference-only ones (Setting.inference)
INFERENCE_SETTINGS = tuple(name for name, setting in SETTINGS.items() if setting.inference)


def parse(argv) -> tuple[EvalRunConfig, dict]:
    """The evaluation's settings, and the attention settings (model config keys) given for --hf."""
    model_fields = dataclass_fields(ModelConfig)
    is_setting = lambda arg: arg.startswith("--") and arg[2:].partition("=")[0].replace("-", "_") in model_fields
    e = EvalRunConfig()
    apply_args(e, [arg for arg in argv if not is_setting(arg)], dataclass_fields(EvalRunConfig))
    given = [arg for arg in argv if is_setting(arg)]
    model = ModelConfig()
    apply_args(model, given, model_fields)
    settings = {key: getattr(model, key) for key in (arg[2:].partition("=")[0].replace("-", "_") for arg in given)}
    trained = [key for key in settings if key not in INFERENCE_SETTINGS]
    if trained and not e.hf:
        raise ConfigError(f"--{trained[0]}: model settings apply to --hf models; a run is evaluated with its own "
                          f"config (--window sets a test-time window; {', '.join(INFERENCE_SETTINGS)} may change)")
    if e.hf:
        problem = unread_settings_problem(model, {key: f"--{key}" for key in settings if key in SETTINGS})
        if problem:
            raise ConfigError(problem)
        if e.hf_decode not in ("full", "variant"):
            raise ConfigError(f"hf_decode={e.hf_decode!r}: expected full or variant")
        if not e.data_dir:
            raise ConfigError(f"--hf needs --data_dir: text prepared with the model's tokenizer, e.g. python "
                              f"-m data.prepare --dataset=NAME --tokenizer={e.hf_tokenizer or e.hf}")
        if e.hf_context < 2:
            raise ConfigError(f"hf_context={e.hf_context}: must be >= 2")
        slug = lambda text: "".join(c if c.isalnum() else "_" for c in text.strip("/").split("/")[-1])
        e.out_dir = e.out_dir or f"out/hf_{slug(e.hf)}_{slug(settings.get('attn_pattern', 'full'))}"
    if not e.out_dir:
        raise ConfigError("--out_dir is required: the run folder to evaluate (or --hf=NAME_OR_PATH for a "
                          "Hugging Face model)")
    unknown = set(e.tasks.split(",")) - set(TASKS)
    if unknown:
        raise ConfigError(f"unknown task(s) {', '.join(sorted(unknown))}: expected some of {', '.join(TASKS)}")
    if e.context_parallel < 1:
        raise ConfigError(f"context_parallel={e.context_parallel}: must be >= 1 (1: whole windows in one process)")
    if e.context_parallel > 1 and (e.tasks != "ppl" or e.hf):
        raise ConfigError(f"context_parallel={e.context_parallel} scores perplexity (--tasks=ppl) of a run's own "
                          "model; evaluate the other tasks, and --hf models, with context_parallel=1")
    unknown = set(e.niah_kinds.split(",")) - set(niah_task.KINDS)
    if unknown:
        raise ConfigError(f"unknown niah subtask(s) {', '.join(sorted(unknown))}: expected {', '.join(niah_task.KINDS)}")
    if e.niah_haystack not in ("val", "embedded") and not os.path.isfile(e.niah_haystack):
        raise ConfigError(f"niah_haystack={e.niah_haystack!r}: expected val, embedded or a text file")
    try:
        depths = [float(d) for d in e.niah_depths.split(",") if d.strip()]
    except ValueError:
        raise ConfigError(f"niah_depths={e.niah_depths!r}: expected fractions such as 0,0.5,1") from None
    if any(not 0 <= d <= 1 for d in depths):
        raise ConfigError(f"niah_depths={e.niah_depths}: every depth must be in [0, 1]")
    if e.ckpt not in ("best", "last"):
        raise ConfigError(f"ckpt={e.ckpt!r}: expected best or last")
    if e.window < 0:
        raise ConfigError(f"window={e.window}: must be >= 0 (0: the trained window)")
    for key in ("ppl_lengths", "ppl_windows", "niah_lengths", "recall_lengths", "diag_distances"):
        try:
            values = ints(getattr(e, key))
        except ValueError:
            raise ConfigError(f"{key}={getattr(e, key)!r}: expected comma-separated integers, e.g. 256,1024") from None
        if any(v < 1 for v in values):
            raise ConfigError(f"{key}={getattr(e, key)}: every value must be >= 1")
    if e.diag_samples < 0:
        raise ConfigError(f"diag_samples={e.diag_samples}: must be >= 0 (0: the paper's prompts per probe)")
    if e.limit < 0 or e.batch_size < 1 or e.niah_samples < 1 or e.niah_candidates < 2 or e.ppl_max_tokens < 2 or \
            e.niah_gen_tokens < 1 or not 1 <= e.niah_digits <= 18:
        raise ConfigError("need limit >= 0, batch_size >= 1, niah_samples >= 1, niah_candidates >= 2, niah_gen_tokens >= 1, "
                          "1 <= niah_digits <= 18, ppl_max_tokens >= 2")
    return e, settings


def config_hash(cfg: Config) -> str:
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:12]


def run_ppl(e: EvalRunConfig, ctx) -> dict:
    cfg, meta = ctx["cfg"], ctx["meta"]
    if e.window_key not in dataclass_fields(type(cfg.model)):
        raise ConfigError(f"window_key={e.window_key!r} is not a model config field")
    lengths = ints(e.ppl_lengths) or [cfg.model.block_size]
    trained = getattr(cfg.model, e.window_key)
    tokens = open_tokens(ctx["data_dir"], "val")
    if len(tokens) > e.ppl_max_tokens:
        print(f"ppl  scores {e.ppl_max_tokens:,} of the {len(tokens):,} validation tokens (--ppl_max_tokens): "
              + ("the first ones, as one stream" if e.ppl_stream else "documents from across the whole split"))
    # the run's own number beside these, on its own validation split only (on other text it would not compare)
    run_val_loss = best_val_loss(Path(e.out_dir)) if ctx.get("own_data") else None
    if e.ppl_stream:
        docs = [ppl_task.stream(tokens, e.ppl_max_tokens)]
    else:
        docs = ppl_task.documents(tokens, meta["eot_id"], e.ppl_max_tokens)
    if ints(e.ppl_windows) and e.window_key not in used_settings(cfg.model):
        raise ConfigError(f"--ppl_windows: no layer of this model ({cfg.model.attn_pattern}) reads {e.window_key}, so "
                          "every window would score the same model; leave out --ppl_windows (or set --window_key to a "
                          "setting its layers have)")
    rows, positions, per_example = [], [], []
    for window in ints(e.ppl_windows) or [e.window or None]:  # None: the model as trained
        model = ctx["with_config"](**({} if window in (None, trained) else {e.window_key: window}))
        for length in lengths:
            if model.wpe is not None and length > cfg.model.block_size:
                note = (f"longer than block_size {cfg.model.block_size} (learned positions cannot extrapolate: a run "
                        "trained with --pos_embedding=rope can be scored at any length)")
                rows.append({"length": length, "window": window, "ppl": None, "nll": None, "tokens": 0, "note": note})
                print(f"ppl  L={length:<6} skipped: {note}")
                continue
            row = ppl_task.perplexity(model, docs, length, e.batch_size, ctx["device"], e.progress, e.limit or None,
                                      ctx.get("shards"))
            window_nll, window_tokens = row.pop("window_nll"), row.pop("window_tokens")
            positions.append({"length": length, "window": window, "nll": row.pop("nll_by_position")})
            # the same windows for every run scored with the same data and settings: pairable
            # (scripts/compare.py --paired A B --task ppl --key nll --by cell)
            cell = f"L{length}" + (f"/w{window}" if window is not None else "")
            per_example += [{"id": f"{cell}/{i}", "cell": cell, "length": length, "window": window, "nll": v,
                             "tokens": n}
                            for i, (v, n) in enumerate(zip(window_nll, window_tokens))]
            rows.append({**row, "window": window, "val_tokens": len(tokens),
                         **({} if run_val_loss is None else {"run_val_loss": run_val_loss})})
            where = f"{e.window_key}={window:<6} " if window is not None else ""
            error = f" ± {row['nll_stderr']:.4f}" if row["nll_stderr"] is not None else ""
            print(f"ppl  L={length:<6} {where}{row['ppl']:10.4f}  (nll {row['nll']:.4f}{error}; {row['tokens']:,} tokens "
                  f"in {row['windows']:,} windows)")
            if row["few_windows"]:
                print(f"warning: ppl L={length}{' ' + where.strip() if where else ''}: only {row['windows']} windows "
                      f"({row['tokens']:,} tokens) were scored, fewer than {ppl_task.MIN_WINDOWS}: a noisy number, "
                      "flagged in the results; score shorter --ppl_lengths or more validation text", file=sys.stderr)
    if run_val_loss is not None:
        print(f"ppl  the run's best validation loss in training: {run_val_loss:.4f} (train.py: random windows of "
              f"block_size {cfg.model.block_size} over the whole split; here document-aligned windows from each "
              "document's start, so the two differ by the windows scored and by noise)")
    return {"rows": rows, "trained_window": trained, "positions": positions, "per_example": per_example}


def best_val_loss(out_dir: Path) -> float | None:
    """The lowest val_loss a run's metrics.jsonl records on the data it trains on now (after its last change of
    data), None without one."""
    path = out_dir / "metrics.jsonl"
    losses = [r["val_loss"] for r in on_current_data(read_metrics(path)) if "val_loss" in r] if path.exists() else []
    return min(losses) if losses else None


def filler_text(tokens, eot_id: int, limit: int = 2_000_000) -> np.ndarray:
    """Up to `limit` tokens of text without end-of-text separators: the haystack retrieval probes hide facts in."""
    tokens = np.asarray(tokens[:limit], dtype=np.int64)
    return tokens[tokens != eot_id]


def essay_text(e: EvalRunConfig, ctx, tokens_needed: int) -> str:
    """The natural text of the essay haystack: the run's validation text, the embedded corpus or a file."""
    if e.niah_haystack == "embedded":
        return "\n".join(documents(200, seed=e.seed))
    if e.niah_haystack != "val":
        return Path(e.niah_haystack).read_text(errors="replace")
    tokens = filler_text(open_tokens(ctx["data_dir"], "val"), ctx["meta"]["eot_id"], limit=max(tokens_needed, 100_000))
    return ctx["tokenizer"].decode(tokens)


def run_niah(e: EvalRunConfig, ctx) -> dict:
    cfg = ctx["cfg"]
    lengths = ints(e.niah_lengths) or [cfg.model.block_size]
    result = niah_task.run(ctx["model"], ctx["tokenizer"], essay_text(e, ctx, 2 * max(lengths)), lengths,
                           [float(d) for d in e.niah_depths.split(",") if d.strip()] or None, e.niah_kinds.split(","),
                           min(e.niah_samples, e.limit or e.niah_samples), e.seed, e.batch_size, e.niah_digits,
                           e.niah_candidates, e.progress, e.niah_gen_tokens)
    for row in result["rows"]:
        if not row["n"]:
            print(f"niah {row['kind']:<16} L={row['length']:<6} skipped: {row.get('note', 'no example')}")
        else:
            depth = "" if row["depth"] is None else f" depth={row['depth']:<5}"
            print(f"niah {row['kind']:<16} L={row['length']:<6}{depth} RULER {100 * row['score']:5.1f}  "
                  f"rank {row['acc_rank']:.2f}")
    return result


def run_recall(e: EvalRunConfig, ctx) -> dict:
    cfg, meta = ctx["cfg"], ctx["meta"]
    rows, per_example = [], []
    fillers = [None]  # the corpus's own
    if e.recall_filler:
        try:
            fillers = [tuple(int(x) for x in part.split(":")) for part in e.recall_filler.split(",")]
        except ValueError:
            fillers = []
        if not fillers or not all(len(f) == 2 and 0 <= f[0] <= f[1] for f in fillers):
            raise ConfigError(f"recall_filler={e.recall_filler!r}: expected MIN:MAX ranges, e.g. 60:80,400:480")
    for filler in fillers:
        options = {"pairs": e.recall_pairs}
        if filler is not None:
            options["min_filler"], options["max_filler"] = filler
        for length in ints(e.recall_lengths) or [cfg.model.block_size]:
            if filler is not None and filler[1] + 8 * e.recall_pairs + 8 > length:
                print(f"recall filler {filler[0]}:{filler[1]} L={length}: skipped (a document would not fit)")
                continue
            row = recall_task.accuracy(ctx["model"], ctx["tokenizer"], meta["eot_id"], length,
                                       min(e.recall_samples, e.limit or e.recall_samples), e.seed, e.batch_size,
                                       ctx["device"], e.progress, **options)
            tag = "" if filler is None else f"{filler[0]}:{filler[1]}"
            rows.append({"filler": tag or "corpus", **row})
            # the same documents for every run with the same seed: pairable (scripts/compare.py --paired)
            cell = (f"F{tag}/" if tag else "") + f"L{length}"  # scripts/compare.py --paired ... --by=cell
            per_example += [{"id": f"{cell}/{i}", "cell": cell, "filler": tag or "corpus", "length": length,
                             "correct": c}
                            for i, c in enumerate(row["correct"])]
            print(f"recall {'filler ' + tag + ' ' if tag else ''}L={length:<6} accuracy {row['accuracy']:.3f} "
                  f"+- {row['stderr']:.3f} (chance {row['chance']:.3f}, {row['n']} documents)")
    return {"rows": rows, "per_example": per_example}


def diagnostics_geometry(e: EvalRunConfig, model_config) -> diagnostics_task.Geometry:
    """The probes' geometry: what the command gives, else the run's own block size b and bridge half-width h
    (bridge_width / 2, or se_bridge's extension e; a block run's h = b / 2, the paper's w = b). A run whose layers
    read no block_len (full, swa) has no boundaries of its own: its b is asked for, never a default's."""
    own = used_settings(model_config)
    block = e.diag_block or (model_config.block_len if "block_len" in own else 0)
    if not block:
        raise ConfigError(f"--tasks=diagnostics: the run's layers ({model_config.attn_pattern}) read no block_len, so "
                          "the probes have no block size of their own: pass --diag_block=B and --diag_half=H, the "
                          "geometry of the runs it is compared with")
    half = e.diag_half or (model_config.bridge_width // 2 if "bridge_width" in own else
                           model_config.bridge_extension if "bridge_extension" in own else block // 2)
    return diagnostics_task.Geometry(e.diag_length or model_config.block_size, block, half)


def run_diagnostics(e: EvalRunConfig, ctx) -> dict:
    cfg, meta = ctx["cfg"], ctx["meta"]
    fact_format = e.diag_format
    if fact_format == "auto":
        fact_format = "recall" if cfg.data.dataset.startswith("recall") else "notes"
    if fact_format not in diagnostics_task.FORMATS:
        raise ConfigError(f"diag_format={e.diag_format!r}: expected auto or {' or '.join(diagnostics_task.FORMATS)}")
    available = diagnostics_task.FORMATS[fact_format]
    probes = e.diag_probes.split(",") if e.diag_probes else list(available)
    unknown = set(probes) - set(available)
    if unknown:
        raise ConfigError(f"diag_probes {', '.join(sorted(unknown))} not available in the {fact_format} format "
                          f"(dataset {cfg.data.dataset}): expected some of {', '.join(available)}"
                          + ("; the semantic probes need --diag_format=notes and a natural-language run"
                             if fact_format == "recall" else ""))
    geometry = diagnostics_geometry(e, cfg.model)
    haystack = filler_text(open_tokens(ctx["data_dir"], "val"), meta["eot_id"])
    result = diagnostics_task.run(ctx["model"], ctx["tokenizer"], haystack, geometry, probes,
                                  min(e.diag_samples or e.limit, e.limit or e.diag_samples),  # the smaller of those set; 0: none
                                  e.seed, ints(e.diag_distances),
                                  e.batch_size, e.progress, fact_format)
    for row in result["rows"]:
        if row["cell"] == "all":
            print(f"diagnostics {row['probe']:<20} accuracy {row['accuracy']:.3f} ({row['n']} prompts, chance 0.25)")
    return result


TASKS = {"ppl": run_ppl, "niah": run_niah, "recall": run_recall, "diagnostics": run_diagnostics}


def summary_markdown(eval_dir: Path) -> str:
    """A markdown summary of every eval/<task>.json in the folder: per task, each evaluation setting's rows."""
    lines = ["# Evaluation summary", ""]
    for path in sorted(eval_dir.glob("*.json")):
        report = json.loads(path.read_text())
        lines += [f"## {report['task']}", ""]
        all_rows = report["results"]["rows"]
        settings = report.get("settings") or {None: {"provenance": report["provenance"]}}
        shown = describe_settings(settings)
        for sid, setting in settings.items():
            prov = setting.get("provenance") or report["provenance"]
            rows = [row for row in all_rows if row.get("setting") == sid]
            if len(settings) > 1:
                lines += [f"### {shown[sid]}", ""]
            source = (f"checkpoint {prov['ckpt']} at step {prov['step']}" if prov.get("step") is not None
                      else f"model {prov.get('ckpt')}")
            lines += [f"`{prov['command']}`  ",
                      f"{source}, git {prov['git_hash']}, config {prov['config_hash']}, seed {prov['seed']}"
                      + (f"; {shown[sid]}" if len(settings) == 1 and shown[sid] != "all examples" else ""), ""]
            if rows:
                keys = [k for k in rows[0] if k not in ("note", "setting") and not isinstance(rows[0][k], list)]
                lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
                for row in rows:
                    cells = [f"{row.get(k):.4g}" if isinstance(row.get(k), float) else str(row.get(k)) for k in keys]
                    lines.append("| " + " | ".join(cells) + " |")
            if report["task"] == "ppl" and rows:
                lines += ["", *ppl_grid(rows, report["results"].get("trained_window"))]
            lines.append("")
    return "\n".join(lines)


def ppl_grid(rows: list[dict], trained_window=None) -> list[str]:
    """Loss (mean NLL) with one row per evaluation window and one column per evaluation length: the layout
    of paper 001's Table 2."""
    lengths = sorted({row["length"] for row in rows})
    windows = list(dict.fromkeys(row["window"] for row in rows))
    cell = {(row["window"], row["length"]): row["nll"] for row in rows}
    # a row without a window is the model as trained, which may have no window at all (full, linear)
    label = lambda w: "as trained" if w is None else f"window {w}" + (" (trained)" if w == trained_window else "")
    lines = ["| loss | " + " | ".join(f"L={length}" for length in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for window in windows:
        values = [cell.get((window, length)) for length in lengths]
        lines.append(f"| {label(window)} | " + " | ".join("-" if v is None else f"{v:.4f}" for v in values) + " |")
    return lines


def load_run(e: EvalRunConfig, device: str, dtype, settings: dict):
    """A trained run's model (under the inference settings given), config, tokenizer, data folder and provenance."""
    model, cfg, ckpt = load_model(e.out_dir, e.ckpt, device)
    if settings:  # INFERENCE_SETTINGS: the same weights
        cfg.model = dataclasses.replace(cfg.model, **settings)
        problem = unread_settings_problem(cfg.model, {key: f"--{key}" for key in settings})
        if problem:
            raise ConfigError(problem)
        try:
            validate_config(cfg.model)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        weights, model = model.state_dict(), GPT(cfg.model).to(device).eval()
        model.load_state_dict(weights)
    tokenizer = run_tokenizer(ckpt)
    print(describe_checkpoint(ckpt))
    data_dir = e.data_dir or cfg.data.data_dir or str(REPO / "data" / cfg.data.dataset)
    model = model.to(dtype)

    def with_config(**changes):
        """The same weights under a changed model config (e.g. another evaluation window)."""
        if not changes:
            return model
        other = GPT(dataclasses.replace(cfg.model, **changes))
        other.load_state_dict(model.state_dict())
        return other.to(device=device, dtype=dtype).eval()

    if e.window:  # a test-time window for every task (ppl takes it as its default --ppl_windows)
        if e.window_key not in dataclass_fields(type(cfg.model)):
            raise ConfigError(f"window_key={e.window_key!r} is not a model config field")
        if model.set_window(e.window) == 0:
            raise ConfigError(f"--window={e.window}: the model of {e.out_dir} ({cfg.model.attn_pattern}) has no "
                              "sliding-window layers")
    source = {"config_hash": config_hash(cfg), "ckpt": ckpt.get("path", str(checkpoint_path(e.out_dir, e.ckpt))),
              "step": ckpt["step"], "tokenizer": checkpoint_tokenizer_identity(ckpt)}
    return model, cfg, tokenizer, data_dir, with_config, source


def data_record(e: EvalRunConfig, cfg: Config, data_dir, meta: dict) -> dict:
    """Which text an evaluation reads, and whether it is the run's own validation split: the split train.py
    recorded (its hash, in config.json) where it did, else the folder the run trained on. A --hf model has no
    split of its own. Results on other data are labelled with its name wherever they are shown."""
    fingerprint = split_fingerprint(data_dir)
    own = False
    if not e.hf:
        try:
            recorded = json.loads((Path(e.out_dir) / "config.json").read_text()).get("data_meta", {}).get("val_sha256")
        except (OSError, ValueError, AttributeError):
            recorded = None
        trained_on = cfg.data.data_dir or str(REPO / "data" / cfg.data.dataset)
        own = fingerprint == recorded if recorded else os.path.realpath(data_dir) == os.path.realpath(trained_on)
    return {"name": Path(os.path.realpath(data_dir)).name, "own": own, "val_tokens": int(meta["val_tokens"]),
            "val_sha256": fingerprint}


def load_hf(e: EvalRunConfig, settings: dict, device: str, dtype_name: str):
    """The same for a Hugging Face model with a variant in its attention (eval/hf_model.py)."""
    if e.window:
        settings = {**settings, e.window_key: e.window}
    model, tokenizer = load_pretrained_lm(e.hf, settings, dtype_name, device, e.hf_context, e.hf_decode,
                                          e.hf_tokenizer)
    cfg = Config(model=model.config)
    cfg.data.dataset, cfg.data.data_dir = Path(e.data_dir).name, e.data_dir
    source = {"config_hash": config_hash(cfg), "ckpt": e.hf, "step": None,
              "attention": {"hf_decode": e.hf_decode, **settings}, "tokenizer": tokenizer.identity()}
    return model, cfg, tokenizer, e.data_dir, model.with_changes, source


def start_context_parallel(P: int, device: str) -> tuple:
    """context_parallel=P: the process group of torchrun's P processes (exit 2 without torchrun or with another
    number of processes), and (group, rank, P); the processes after the first print and write nothing."""
    world = int(os.environ.get("WORLD_SIZE", 0))
    if "RANK" not in os.environ or world != P:
        print(f"error: context_parallel={P} scores each window over {P} processes: run it under torchrun with "
              f"exactly {P} (torchrun --standalone --nproc_per_node={P} -m eval ...)", file=sys.stderr)
        sys.exit(2)
    rank = int(os.environ["RANK"])
    torch.distributed.init_process_group("nccl" if str(device).startswith("cuda") else "gloo")
    if rank:
        sys.stdout = sys.stderr = open(os.devnull, "w")
    return None, rank, P


def main(argv):
    # --wandb is where results go, not how they are computed: outside EvalRunConfig, whose fields make the setting
    wandb_args = [arg for arg in argv if arg.partition("=")[0] == "--wandb"]
    to_wandb = exit_on_config_error(coerce, "wandb", wandb_args[-1].partition("=")[2], bool) if wandb_args else True
    e, settings = exit_on_config_error(parse, [arg for arg in argv if arg not in wandb_args])
    device = exit_on_config_error(resolve_device, e.device)
    shards = start_context_parallel(e.context_parallel, device) if e.context_parallel > 1 else None
    master = shards is None or shards[1] == 0
    problem = writable_folder_problem(Path(e.out_dir) / "eval")  # before any work: results go there
    if problem:
        print(f"error: cannot write the results: {problem}", file=sys.stderr)
        sys.exit(2)
    trained = [name for name in holds_run(Path(e.out_dir)) if name.startswith("ckpt_") or name == "metrics.jsonl"]
    if e.hf and trained:  # a --hf evaluation writes the folder's config.json: never over a training run's
        print(f"error: {e.out_dir} holds a training run ({', '.join(trained)}): a --hf model's results there would "
              f"replace its config.json and read as that run's; give --out_dir a folder of its own "
              f"(e.g. --out_dir=out/hf_{Path(e.hf).name})", file=sys.stderr)
        sys.exit(2)
    dtype_name = e.hf_dtype or (e.dtype if e.dtype != "auto" else simulate_cuda.auto_dtype(device))
    torch.manual_seed(e.seed)
    try:
        if e.hf:
            model, cfg, tokenizer, data_dir, with_config, source = load_hf(e, settings, device, dtype_name)
        else:
            model, cfg, tokenizer, data_dir, with_config, source = load_run(e, device, getattr(torch, dtype_name),
                                                                            settings)
        meta = load_meta(data_dir)
        # the data's tokens must be the model's: a checkpoint's tokenizer as trained, a --hf model's own
        problem = tokenizer_mismatch(source["tokenizer"], meta, data_dir, "the model" if e.hf else f"{source['ckpt']}")
        if problem:
            raise DataError(problem)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
    except (CheckpointError, TokenizerUnavailable, DataError, PretrainedError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    if shards is not None and model.context_parallel_problems():
        print(f"error: context_parallel={e.context_parallel}: {model.context_parallel_problems()[0]}", file=sys.stderr)
        sys.exit(2)
    if drawn_per_forward(cfg.model):
        print(f"note: the results are drawn per forward: {drawn_per_forward(cfg.model)} (and --seed)",
              file=sys.stderr)
    if cfg.model.document_mask:
        print(f"note: scored with the run's document mask (document_mask=True, eot_id={cfg.model.eot_id}): each "
              "end-of-text token begins a document that nothing before it in the window reaches", file=sys.stderr)
    data = data_record(e, cfg, data_dir, meta)
    if not e.hf and not data["own"]:
        print(f"note: {data_dir} is not this run's own validation split: its results are kept apart "
              f"from the run's own, labelled data={data['name']} (in summary.md and scripts/compare.py)",
              file=sys.stderr)
    ctx = {"model": model, "cfg": cfg, "meta": meta, "tokenizer": tokenizer, "data_dir": data_dir,
           "device": device, "with_config": with_config, "own_data": data["own"], "shards": shards}
    eval_dir = Path(e.out_dir) / "eval"
    eval_dir.mkdir(parents=True, exist_ok=True)
    if e.hf:  # the evaluated model's resolved config, so scripts/compare.py reads the folder as a run
        cfg.train.init_from = f"hf:{e.hf}"
        write_json(cfg.to_dict(), Path(e.out_dir) / "config.json")
    provenance = {"command": " ".join([os.path.basename(sys.executable), "-m", "eval", *argv]),
                  "git_hash": git_hash(), "seed": e.seed, **source, "data_tokenizer": tokenizer_identity(meta),
                  "eval_config": dataclasses.asdict(e), "device": device, "dtype": dtype_name, "data": data,
                  "document_mask": cfg.model.document_mask,
                  **({"inference_settings": settings} if settings and not e.hf else {})}
    failed, tasks = [], e.tasks.split(",")
    for number, task in enumerate(tasks):
        started = time.time()
        try:
            with torch.no_grad():  # every task only reads the model: no autograd graph, no saved activations
                result = TASKS[task](e, ctx)
        except (ConfigError, ValueError) as err:  # report, and still finish the other tasks
            print(f"error in task {task}: {err}", file=sys.stderr)
            failed.append(task)
            continue
        except KeyboardInterrupt:  # one line: what is written (whole files only), what is not
            written = [t for t in tasks[:number] if t not in failed]
            atomic_write(eval_dir / "summary.md", lambda f: f.write(summary_markdown(eval_dir).encode()))
            print(f"interrupted during task {task}: "
                  + (f"{', '.join(f'{t}.json' for t in written)} written, " if written else "")
                  + f"{', '.join(tasks[number:])} not (their earlier results, if any, are as they were); "
                  f"summary.md in {eval_dir}", file=sys.stderr)
            sys.exit(130)
        if not master:  # the group's other processes scored the same windows: the first writes the results
            continue
        with held(eval_dir / ".lock"):  # another evaluation of this run may be merging into the same file
            write_json(merged_report(eval_dir / f"{task}.json", task, result, e, data_dir,
                                     {**provenance, "seconds": time.time() - started}), eval_dir / f"{task}.json")
    if shards is not None:
        torch.distributed.destroy_process_group()
        if not master:
            return
    atomic_write(eval_dir / "summary.md", lambda f: f.write(summary_markdown(eval_dir).encode()))
    done = [t for t in tasks if t not in failed]
    print(f"wrote {', '.join(f'{t}.json' for t in done) or 'no task result'}; summary.md in {eval_dir}")
    # into the summary of the wandb run the run trained in, if it logged to one (only then are the results reread)
    if to_wandb and done and read_record(e.out_dir) is not None:
        report_evaluation(e.out_dir, evaluation_summary(e.out_dir, done))
    if failed:
        sys.exit(2)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt:  # before the tasks (loading the model or the data): nothing was written
        print("interrupted before any task ran: no result written", file=sys.stderr)
        sys.exit(130)
