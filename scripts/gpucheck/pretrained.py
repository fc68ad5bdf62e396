"""The pretrained step: a small local Hugging Face model fine-tuned with init_from=hf: and evaluated with
python -m eval --hf=."""

import json
import math
import shlex

from scripts.gpucheck.context import StepContext, outcome
from scripts.gpucheck.tiny_hf import build_tiny_hf_model
from scripts.gpucheck.training import fresh_run_dir, run_summary


def step_pretrained(ctx: StepContext) -> dict:
    """A small local Qwen3 (grouped-query attention) in bf16: fine-tuned from init_from=hf: with a sliding window
    in its attention (compiled on CUDA), and evaluated with python -m eval --hf=: about 40 s."""
    root = fresh_run_dir(ctx.out / "pretrained")
    folder, data_dir = build_tiny_hf_model(root)
    dtype = "bfloat16" if ctx.gpu_path else "float32"
    train = ["train.py", f"--init_from=hf:{folder}", f"--data_dir={data_dir}", f"--out_dir={root / 'run'}",
             "--attn_pattern=swa", "--swa_window=32", "--block_size=128", "--batch_size=4",
             "--gradient_accumulation_steps=1", "--max_iters=10", "--warmup_iters=2", "--lr_decay_iters=10",
             "--learning_rate=1e-3", "--eval_interval=10", "--eval_iters=2", "--log_interval=5",
             f"--compile={ctx.gpu_path}", f"--device={ctx.device}", f"--dtype={dtype}"]
    done = ctx.run([ctx.python, *train], "pretrained_train")
    if done.timed_out or done.returncode != 0:
        return outcome("failed", "init_from=hf: failed", None, done.error())
    metrics = run_summary(root / "run" / "metrics.jsonl")
    evaluate = [ctx.python, "-m", "eval", f"--hf={folder}", f"--data_dir={data_dir}", f"--out_dir={root / 'eval'}",
                "--attn_pattern=swa", "--swa_window=32", "--tasks=ppl", "--ppl_lengths=128", "--limit=4",
                f"--device={ctx.device}", f"--dtype={dtype}", "--progress=False"]
    done = ctx.run(evaluate, "pretrained_eval")
    report = root / "eval" / "eval" / "ppl.json"
    if done.timed_out or done.returncode != 0 or not report.exists():
        return outcome("failed", "python -m eval --hf= failed", None, done.error())
    ppl = json.loads(report.read_text())
    results = {"train": {"val_loss_start": metrics["val_loss_start"], "val_loss_end": metrics["val_loss_end"],
                         "command": shlex.join(["python", *train])},
               "eval": {"command": shlex.join(["python", *evaluate[1:]]), "results": ppl.get("results")}, "dtype": dtype}
    losses = [metrics["val_loss_start"], metrics["val_loss_end"]]
    if None in losses or not all(math.isfinite(x) for x in losses) or not losses[1] < losses[0]:
        return outcome("failed", f"fine-tuning from the Hugging Face model: val loss {losses}", results)
    return outcome("passed", f"init_from=hf: val loss {losses[0]:.3f} -> {losses[1]:.3f} ({dtype}); eval --hf= "
                             "wrote ppl.json", results)
