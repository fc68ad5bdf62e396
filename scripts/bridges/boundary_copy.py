"""Paper 004's Theorem 2, demonstrated: fixed blocks cannot copy a token across a block boundary.

Each sequence of 2b tokens has a boundary at p = b. The label is the token just before it, x_{p-1}, uniform
over K symbols; x_p is a fixed marker (so the block prefix B_1 ∩ [0, p] = {p} carries no information about the
label) and the other positions are random filler. The model reads the label out at p: the only counted
target is targets[p] = x_{p-1}. Under fixed-block attention h_p does not depend on x_{p-1} at any depth
(Lemma 1), so the K labels get the same prediction: top-1 accuracy at most 1/K and cross-entropy over the K
candidates at least log K (Eq. 12-13). One edge (p-1 -> p) is enough to copy it (Lemma 2), and bridge, pbb,
se_bridge and swa all have it.

The evaluation is balanced: every evaluation context appears once with each of the K labels, so for a block
model the accuracy is exactly 1/K and the loss exactly >= log K, and the largest difference between the
logits at p across labels (Lemma 1) is reported.

    python -m scripts.bridges.boundary_copy                       # K = 8, five patterns, a few seconds each on CPU
    python -m scripts.bridges.boundary_copy --K=4 --steps=400 --patterns=block,pbb --json=out/boundary_copy.json
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass

import torch

if not __package__:  # run as a file, the project's modules cannot be imported: say how to run it
    sys.exit("run it from the repository root as a module: python -m scripts.bridges.boundary_copy ...")

from config import ConfigError, ModelConfig, apply_args, dataclass_fields, exit_on_config_error  # noqa: E402
from model import GPT  # noqa: E402
from common.outputs import write_json  # noqa: E402


def sequences(labels: torch.Tensor, filler: torch.Tensor, block: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, 2b) and targets: label tokens 0..K-1, marker K at p = b, filler ids above K."""
    x = filler.clone()
    x[:, block - 1] = labels
    x[:, block] = K  # the fixed marker: the block prefix of p does not vary with the label
    targets = torch.full_like(x, -1)
    targets[:, block] = labels
    return x, targets


def random_filler(batch: int, block: int, K: int, vocab: int, generator) -> torch.Tensor:
    return torch.randint(K + 1, vocab, (batch, 2 * block), generator=generator)


def run(pattern: str, K: int = 8, block: int = 16, steps: int = 300, batch: int = 64, lr: float = 3e-3,
        eval_contexts: int = 64, seed: int = 0, vocab: int = 64) -> dict:
    cfg = ModelConfig(arch="gpt2", n_layer=2, n_head=2, n_embd=32, block_size=2 * block, vocab_size=vocab,
                      attn_pattern=pattern, block_len=block, swa_window=block, bridge_width=block,
                      bridge_extension=block // 2, dropout=0.0)
    torch.manual_seed(seed)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        labels = torch.randint(0, K, (batch,), generator=g)
        x, y = sequences(labels, random_filler(batch, block, K, vocab, g), block, K)
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    model.eval()
    g_eval = torch.Generator().manual_seed(seed + 1)
    filler = random_filler(eval_contexts, block, K, vocab, g_eval).repeat_interleave(K, 0)  # every label per context
    labels = torch.arange(K).repeat(eval_contexts)
    x, _ = sequences(labels, filler, block, K)
    with torch.no_grad():
        logits = model(x)[0][:, block, :K].double()  # the readout at p, over the K candidates
    log_probs = torch.log_softmax(logits, -1)
    per_context = logits.view(eval_contexts, K, K)
    return {"pattern": pattern, "K": K, "accuracy": (logits.argmax(-1) == labels).double().mean().item(),
            "loss": -log_probs[torch.arange(len(labels)), labels].mean().item(),
            "chance_accuracy": 1 / K, "log_K": math.log(K),
            # Lemma 1: under fixed blocks the readout is the same whatever the label
            "max_logit_change_across_labels": (per_context - per_context[:, :1]).abs().max().item()}


@dataclass
class CopyConfig:
    patterns: str = "block,bridge,pbb,se_bridge,swa"  # comma-separated attention patterns to train
    K: int = 8  # label symbols (a fixed-block model reaches at most 1/K accuracy)
    block: int = 16  # block length (even); the boundary is at position block
    steps: int = 300
    seed: int = 0
    json: str = ""  # also write the results here


def parse(argv) -> CopyConfig:
    args = CopyConfig()
    apply_args(args, argv, dataclass_fields(CopyConfig))
    if args.K < 2 or args.block < 4 or args.block % 2 or args.steps < 1:
        raise ConfigError(f"K={args.K}, block={args.block}, steps={args.steps}: need K >= 2, an even block >= 4 "
                          "and steps >= 1")
    return args


def main(argv):
    args = exit_on_config_error(parse, argv)
    print(f"K-way boundary copy: K={args.K}, block {args.block}, boundary at p={args.block}, {args.steps} steps; "
          f"bound for fixed blocks: accuracy <= {1 / args.K:.3f}, loss >= log K = {math.log(args.K):.3f}")
    print(f"{'pattern':<10} {'accuracy':>9} {'loss':>8} {'max logit change across labels':>32}")
    results = []
    for pattern in args.patterns.split(","):
        r = run(pattern, args.K, args.block, args.steps, seed=args.seed)
        results.append(r)
        print(f"{pattern:<10} {r['accuracy']:>9.3f} {r['loss']:>8.3f} {r['max_logit_change_across_labels']:>32.3g}",
              flush=True)
    if args.json:
        write_json({"args": asdict(args), "results": results}, args.json)


if __name__ == "__main__":
    main(sys.argv[1:])
