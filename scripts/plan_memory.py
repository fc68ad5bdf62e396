"""Per-GPU memory of a training config under DDP or FSDP, and the largest micro-batch that fits a GPU.

    python -m scripts.plan_memory configs/swax/swax_1p4b_stochastic.py --gpu_mem_gb=80 --world_size=8
    python -m scripts.plan_memory configs/sa/slimpajama_360m_sa_swa.py --world_size=4 --json=out/plan.json
    python -m scripts.plan_memory configs/swax/swax_7b_stochastic.py --world_size=8       # parallelism=fsdp: sharded
    python -m scripts.plan_memory configs/bridges/owt_124m_pbb.py --batch_size=16 --activation_checkpointing=full

Weights, gradients, AdamW state and autocast copies under DDP or FSDP, then one micro-batch's activations
under each activation checkpointing mode, and the largest micro-batch (with the gradient_accumulation_steps
that keeps the config's global batch) that fits gpu_mem_gb less the headroom: how each is counted is in
runtime/memory_plan.py, the library this is the command line of.

The estimate is of eager PyTorch (torch.compile's partitioner usually keeps less: it fuses the casts and
recomputes cheap elementwise work) on the kernels of `--kernels`: cuda (default: FlexAttention for windowed
attention, SDPA's flash kernel for full attention, mlstm_kernels' and fla's Triton kernels for the recurrent
mixers when their *_kernel setting allows it, as requirements-gpu.txt installs them) or cpu (the chunked CPU
kernels and the built-in chunked recurrent forms: what the tests measure). Sizes are in GiB (2^30 bytes), as
torch.cuda reports them; --gpu_mem_gb is in the same unit. Extra
--key=value arguments override the config as in train.py; vocab_size=0 (from the data) is planned with 50304
(GPT-2's padded vocabulary) and says so.
"""

import os
import sys

if not __package__:  # run as a file, the project's modules cannot be imported: say how to run it
    sys.exit("run it from the repository root as a module: python -m scripts.plan_memory ...")

from config import (HELP_FLAGS, ConfigError, apply_args, config_files, dataclass_fields,  # noqa: E402
                    exit_on_config_error, print_help, split_args)
from runtime.memory_plan import PlanOptions, plan  # noqa: E402
from common.outputs import write_json  # noqa: E402


# ---- command line -------------------------------------------------------------------------------------------------

def parse(argv) -> tuple[PlanOptions, list[str]]:
    """Split the plan's own --key=value options from the config file and its overrides."""
    options = PlanOptions()
    own = dataclass_fields(PlanOptions)
    if any(arg in HELP_FLAGS for arg in argv):
        print_help(options, own, "Every other --key=value is a training config's (python train.py --help).")
        raise SystemExit(0)
    mine, rest = split_args(argv, own)
    apply_args(options, mine, own)
    if not config_files(rest):
        raise ConfigError("give a config file, e.g. python -m scripts.plan_memory configs/bridges/owt_124m_full.py")
    if options.gpu_mem_gb <= 0 or options.world_size < 1 or not 0 <= options.headroom < 1:
        raise ConfigError("need gpu_mem_gb > 0, world_size >= 1 and 0 <= headroom < 1")
    if options.kernels not in ("cuda", "cpu"):
        raise ConfigError(f"kernels={options.kernels!r}: expected cuda or cpu")
    if options.compare_loss_chunk < 1:
        raise ConfigError("compare_loss_chunk must be >= 1")
    return options, rest


def print_plan(r: dict) -> None:
    c = r["configured"]
    mixers = ", ".join(f"{name} x {count}" for name, count in r["mixers"].items())
    vocab = " (vocab_size=0 takes the data's vocabulary: planned with 50,304)" if r["vocab_assumed"] else ""
    print(f"{' '.join(r['config'])}: {r['n_params'] / 1e9:.3f}B parameters ({r['n_cast'] / 1e9:.3f}B of them cast to "
          f"bf16 by autocast); layers {mixers}; block_size {r['block_size']:,}; vocab {r['vocab_size']:,}{vocab}")
    print(f"global batch: {r['batch_size']} x {r['gradient_accumulation_steps']} x {r['block_size']:,} = "
          f"{r['global_tokens']:,} tokens per step ({r['global_sequences']} sequences) on {r['world_size']} GPU(s) "
          f"under {r['parallelism'].upper()}")
    precision = "float32" if r["activation_bytes"] == 4 else \
        ("bf16 through FSDP's mixed-precision policy" if r["parallelism"] == "fsdp" else "bf16 autocast")
    print(f"estimate: eager PyTorch, {r['kernels']} kernels, {precision}; GiB = 2^30 bytes")
    print(f"\nmemory per GPU at batch_size={c['batch_size']}, activation_checkpointing={c['activation_checkpointing']}, "
          f"loss_chunk={c['loss_chunk']}:{'GiB':>14}")
    for name, size in c["breakdown_gib"].items():
        print(f"  {name:<72} {size:>8.2f}")
    verdict = "fits" if r["configured_fits"] else "does NOT fit"
    print(f"  {'total':<72} {c['total_gib']:>8.2f}  {verdict} in {r['budget_gib']:.1f} GiB "
          f"({r['gpu_mem_gib']:g} GiB less {100 * r['headroom']:g}% headroom)")
    print(f"activations saved for backward per layer at batch_size={c['batch_size']} (largest parts, GiB):")
    for mixer, layer in c["layers"].items():
        parts = sorted(layer["saved"].items(), key=lambda item: -item[1])[:4]
        print(f"  {mixer} x {layer['count']}: {layer['saved_gib']:.2f} each")
        print("    " + "; ".join(f"{name} {size:.2f}" for name, size in parts))
    if "error" in r:
        print(f"\n{r['error']}")
        return
    per_gpu = r["global_sequences"] // r["world_size"]
    print(f"\nlargest micro-batch that fits {r['budget_gib']:.1f} GiB and keeps the global batch "
          f"({r['global_sequences']} sequences, {per_gpu} per GPU per step):")
    print(f"  {'activation_checkpointing':<25} {'loss_chunk':>10} {'batch_size':>10} {'accumulation':>12} "
          f"{'GiB/GPU':>8}")
    for fit in r["fits"]:
        if fit["batch_size"] is None:
            print(f"  {fit['activation_checkpointing']:<25} {fit['loss_chunk']:>10} {'-':>10} {'-':>12} "
                  f"{fit['total_gib']:>8.2f}  (at batch_size 1: does not fit)")
        else:
            print(f"  {fit['activation_checkpointing']:<25} {fit['loss_chunk']:>10} {fit['batch_size']:>10} "
                  f"{fit['gradient_accumulation_steps']:>12} {fit['total_gib']:>8.2f}")
    if r["suggested"]:
        best = r["suggested"]
        print(f"suggested (the least recomputation that fits): --batch_size={best['batch_size']} "
              f"--gradient_accumulation_steps={best['gradient_accumulation_steps']} "
              f"--activation_checkpointing={best['activation_checkpointing']} --loss_chunk={best['loss_chunk']}")
    if r["static_exceeds_budget"]:
        if r["parallelism"] == "ddp":
            print(f"weights, gradients, DDP buckets, AdamW and autocast copies alone take {r['static_gib']:.1f} GiB per "
                  f"GPU, more than {r['budget_gib']:.1f}: this model cannot train under DDP (every GPU holds all of it); "
                  "shard it with --parallelism=fsdp")
        else:
            print(f"the sharded state and gathered weights alone take {r['static_gib']:.1f} GiB per GPU, more than "
                  f"{r['budget_gib']:.1f}: use more GPUs (--world_size)")


def main(argv):
    options, config_args = exit_on_config_error(parse, argv)
    result = exit_on_config_error(plan, options, config_args)
    print_plan(result)
    if options.json:
        os.makedirs(os.path.dirname(options.json) or ".", exist_ok=True)
        write_json(result, options.json)


if __name__ == "__main__":
    main(sys.argv[1:])
