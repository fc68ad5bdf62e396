"""The run folder's files as training writes them: config.json (the resolved config, every invocation of the run,
the data's meta), the run's tokenizer, metrics.jsonl and wandb (opened here, cut back to the checkpoint on
resume); what the run trains is said once, as the folder is opened."""

import json
import os
from pathlib import Path

import torch

from attention.capabilities import resolved_settings as mixer_resolved_settings
from attention.registry import MIXERS
from common.machine import openmp_note
from common.outputs import write_json
from config import Config
from data.meta import open_tokens, split_fingerprint, unigram_entropy
from data.tokenizer import TokenizerUnavailable
from runtime.checkpoint import keep_tokenizer, remove_stale_temp_files, run_info
from runtime.wandb_run import X_AXIS, start_run
from training.evaluation import describe_budget, eval_budget
from training.failures import fail, write_failure
from training.metrics import MetricsLog
from training.schedules import schedule_warning
from training.setup import Progress, RunData, Runtime


class RunFolder:
    """The run folder's files: config.json, metrics.jsonl (and wandb), the checkpoints written so far. Rank 0
    writes them; a failed write ends the run with one line saying what is intact."""

    def __init__(self, out_dir: Path, fsdp: bool, saved_steps: dict):
        self.out_dir, self.fsdp, self.saved_steps = out_dir, fsdp, saved_steps  # saved: checkpoint -> its step
        self.metrics, self.info, self.unigram = None, None, None

    def cannot_write(self, name: str, error: OSError):
        fail(write_failure(error, self.out_dir, name, self.fsdp, self.saved_steps))


def resolved_settings(cfg: Config, rt: Runtime, raw_model) -> dict:
    """What the run's "auto" settings became here (the device, the dtype, the positions, each layer's kernels:
    attention/capabilities.py resolved_settings), for config.json: compare shows what ran, not "auto"."""
    values = {"device": str(rt.device), "dtype": str(rt.dtype).removeprefix("torch."),
              "pos_embedding": cfg.model.resolved_pos_embedding}
    per_setting: dict = {}
    for block in raw_model.blocks:
        for key, value in mixer_resolved_settings(block.mixer, cfg.model.block_size, rt.device, rt.dtype).items():
            per_setting.setdefault(key, [])
            if value not in per_setting[key]:
                per_setting[key].append(value)
    values.update({key: "+".join(map(str, found)) for key, found in per_setting.items()})
    return values


def run_invocations(path: Path, cfg: Config, info: dict, progress: Progress) -> list[dict]:
    """Every invocation of the run, in order, as config.json keeps them: each one's command, code version and
    start (run_info), the step it started from, and the settings it changed from the one before (a resume may
    raise max_iters or change eval_iters). A fresh run starts the list; a resumed one appends to it."""
    earlier, before = [], {}
    if progress.ckpt_step is not None and path.exists():
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            old = {}
        earlier = old.get("invocations") or ([{**old["run"], "from_step": 0}] if "run" in old else [])
        before = {section: old.get(section, {}) for section in ("model", "data", "train", "eval")}
    now = cfg.to_dict()
    changed = {f"{section}.{key}": [before[section].get(key), value]
               for section in before for key, value in now.get(section, {}).items()
               if key in before[section] and before[section][key] != value}
    entry = {**info, "from_step": progress.step}
    if changed:
        entry["changed"] = changed
    if progress.data_change:
        entry["data_change"] = progress.data_change["changes"]
    return [*earlier, entry]


def open_run_folder(cfg: Config, rt: Runtime, data: RunData, raw_model, progress: Progress, argv) -> RunFolder:
    """Rank 0 writes the resolved config (with the data's meta) and says what is trained on what, starts the
    wandb run and opens metrics.jsonl (on resume, dropping what was logged after the checkpoint)."""
    m, t, ev = cfg.model, cfg.train, cfg.eval
    folder = RunFolder(Path(t.out_dir), rt.fsdp, {t.resume_from: progress.step} if progress.ckpt_step is not None
                       else {})
    if not rt.master:
        return folder
    out_dir, meta = folder.out_dir, data.meta
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(out_dir)
    folder.info = info = run_info(rt.world_size)
    invocations = run_invocations(out_dir / "config.json", cfg, info, progress)
    folder.unigram = unigram = unigram_entropy(open_tokens(data.data_dir, "val")[:10_000_000], meta["vocab_size"])
    try:
        write_json({**cfg.to_dict(), "run": info, "invocations": invocations,
                    "resolved": resolved_settings(cfg, rt, raw_model),
                    "data_meta": {**meta, "unigram_entropy": unigram,
                                                               "val_sha256": split_fingerprint(data.data_dir)}},
                   out_dir / "config.json")
    except OSError as e:
        folder.cannot_write("config.json", e)
    try:  # the run keeps its own tokenizer: sampling, evaluation and export need nothing outside the folder
        keep_tokenizer(meta["tokenizer"], out_dir)
    except OSError as e:
        folder.cannot_write("tokenizer.json", e)
    except TokenizerUnavailable as e:
        print(f"warning: the run keeps no copy of its tokenizer ({str(e).splitlines()[0]}): sampling and evaluation "
              f"will need {meta['tokenizer']!r} where it is now")
    n_params = raw_model.num_params()
    embedding_share = 1 - raw_model.num_params(exclude_embeddings=True) / n_params
    print(f"model: {m.arch}, {m.n_layer} layers x {m.n_head} heads x {m.n_embd}, mixers {m.attn_pattern!r}: "
          f"{n_params / 1e6:.2f}M parameters ({raw_model.num_params(exclude_embeddings=True) / 1e6:.2f}M "
          "without embeddings)" + ("; packed documents masked (document_mask)" if m.document_mask else ""))
    if embedding_share > 0.5:  # e.g. GPT-2's 50K tokens at the quick start's n_embd: a much slower model
        print(f"note: the embedding is {100 * embedding_share:.0f}% of the parameters ({m.vocab_size:,} tokens x "
              f"{m.n_embd}): the vocabulary, not the layers, sets this model's size and speed; a smaller vocabulary "
              "(the byte tokenizer) or a larger model puts them in the layers")
    layers_of = {}  # e.g. per-head windows of multi-scale variants; layers alike are said once
    for i, block in enumerate(raw_model.blocks):
        if block.mixer.describe():
            layers_of.setdefault(block.mixer.describe(), []).append(str(i))
    for description, layers in layers_of.items():
        print(f"  layer{'s' if len(layers) > 1 else ''} {', '.join(layers)}: {description}")
    print(f"data: {data.data_dir} ({meta['tokenizer']} tokenizer, {meta['train_tokens']:,} train / "
          f"{meta['val_tokens']:,} val tokens); {progress.tokens_per_step:,} tokens per step; "
          f"{rt.world_size} process(es) on {rt.device}, {str(rt.dtype).removeprefix('torch.')}"
          + (f"; context parallel: each sequence cut into {rt.cp} shards of {m.block_size // rt.cp} tokens, "
             f"{rt.dp_size} data-parallel group(s) of {rt.cp}" if rt.cp > 1 else ""))
    if rt.shard is not None:  # what each layer exchanges, and where a rule falls back to every earlier key
        exchanges, names = {}, {cls: name for name, cls in MIXERS.items()}
        for block in raw_model.blocks:
            line = block.mixer.context_parallel_exchange(rt.shard, torch.finfo(rt.dtype).bits // 8)
            exchanges.setdefault(f"{names.get(type(block.mixer), type(block.mixer).__name__)} layers: {line}")
        print("context parallel, per layer and process in forward (as much back in backward): "
              + "; ".join(exchanges))
    print(f"unigram baseline (val token entropy): {unigram:.4f} nats")
    if schedule_warning(t):
        print(schedule_warning(t))
    if rt.device.type == "cpu":
        print(openmp_note())
    wandb_run = None
    if rt.wandb_mode:
        try:
            wandb_run = start_run(cfg, out_dir, argv, rt.wandb_mode, progress.wandb_run_id,
                                  resuming=progress.ckpt_step is not None, run=info, n_params=n_params)
        except OSError as e:
            folder.cannot_write("wandb.json", e)
        progress.wandb_run_id = wandb_run.id
        print(f"wandb: run {wandb_run.id} ({rt.wandb_mode}) in group {wandb_run.group!r}, tags "
              f"{', '.join(wandb_run.tags) or 'none'}; metrics against {X_AXIS} ({progress.tokens_per_step:,} per "
              "step)")
    folder.metrics = MetricsLog(out_dir / "metrics.jsonl", wandb_run, on_write_error=folder.cannot_write,
                                tokens_at=progress.tokens_at)
    step = progress.step
    if step > 0 or progress.data_change:
        # the evaluation at the resumed step runs again (in the loop): its earlier records are dropped, unless the
        # data changed (then they are the earlier data's, and stay)
        reevaluated = not progress.data_change and (step % ev.eval_interval == 0 or step == t.max_iters
                                                    or ev.eval_only)
        try:
            folder.metrics.truncate_after(step, reevaluated=reevaluated)
        except ValueError as e:
            fail(str(e))
        except OSError as e:
            folder.cannot_write("metrics.jsonl", e)
        if progress.data_change:
            keep_records_before_data_change(folder, progress)
    elif (out_dir / "metrics.jsonl").exists():
        (out_dir / "metrics.jsonl").unlink()  # a resume from step 0: its log starts again
    if progress.ckpt_step is not None:
        print(f"resumed from {out_dir / (f'ckpt_{t.resume_from}' + ('' if rt.fsdp else '.pt'))} at step {step}"
              + ("" if progress.data_change else f" (best val loss {progress.best_val_loss:.4f})"))
        if progress.best_budget not in (None, eval_budget(cfg)):
            print(f"note: that best val loss was measured with {describe_budget(progress.best_budget)}; this run "
                  f"evaluates with {describe_budget(eval_budget(cfg))}, another number over other windows: until a "
                  "loss of this run beats it, every line says which budget the best comes from")
    return folder


def keep_records_before_data_change(folder: RunFolder, progress: Progress) -> None:
    """A resume on other data (allow_data_change), its log kept up to the checkpoint's step (the evaluation there
    included: the loop evaluates again, on the new data, and logs it after them): the change is logged, and the best
    checkpoint so far, best on the earlier data, is kept under a name that says so; the best on the new data
    starts from the next evaluation."""
    step, change, out_dir = progress.step, progress.data_change, folder.out_dir
    kept = ""
    for best in (out_dir / "ckpt_best.pt", out_dir / "ckpt_best"):
        if best.exists():
            renamed = out_dir / earlier_best_name(out_dir, step, best.suffix)
            try:
                os.replace(best, renamed)
            except OSError as e:
                folder.cannot_write(renamed.name, e)
            kept = f"; the best checkpoint on the earlier data is kept as {renamed.name}"
    folder.metrics.log(step, to_wandb=False, data_change=change)
    print(f"data changed at step {step} (--allow_data_change=True): " + "; ".join(change["changes"])
          + f". Losses from here are on the new data, recorded in metrics.jsonl after the change; the best val loss "
          f"starts again at this step's evaluation{kept}")


def earlier_best_name(out_dir: Path, step: int, suffix: str) -> str:
    """ckpt_best_data_before_step{step}[.pt]: the best checkpoint of the data a run trained on before step."""
    name, n = f"ckpt_best_data_before_step{step}", 1
    while (out_dir / f"{name}{suffix}").exists():  # a second change at the same step
        n += 1
        name = f"ckpt_best_data_before_step{step}_{n}"
    return name + suffix
