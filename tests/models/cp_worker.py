"""One process of a context-parallel group on gloo (tests/models/test_context_parallel.py starts P of them): for each
case, the loss and every parameter's gradient of one forward and backward over shards, against the same model run
whole in this process. Writes {case: {...}} as JSON (rank 0).

    python tests/models/cp_worker.py RANK WORLD CP PORT OUT CASE[,CASE...] --n=N --window=W [--modules=FILE,...]

--modules: variant files to register first (a variant written in one file, outside attention/).
--compile=BACKEND: the shards' blocks torch.compiled with BACKEND (as train.py's compile does).
--documents=0|1: only without, or only with, document_mask (default: both).
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from attention.ops.shard import Shard  # noqa: E402
from attention.registry import example_cases  # noqa: E402

EOT = 5
VOCAB = 61


def config_for(case: str, n: int, window: int):
    from config import ModelConfig  # after --modules (see main)

    settings = {"arch": "llama", "n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": n, "vocab_size": VOCAB,
                "bias": False, "eot_id": EOT, "dropout": 0.0, **example_cases(window)[case]}
    return ModelConfig(**settings)


def tokens(n: int, cp: int, batch: int = 2):
    """Row 0: documents that start exactly at a shard's start, one token before a shard's start, and one that
    spans three shards (where there are three); row 1: one stream."""
    idx = torch.randint(6, VOCAB, (batch, n), generator=torch.Generator().manual_seed(1))
    length = n // cp
    idx[0, length] = EOT  # an end-of-text token begins a document: the second shard starts one
    if cp > 2:
        idx[0, 2 * length - 1] = EOT  # one token before the third shard
    targets = torch.roll(idx, -1, 1)
    targets[:, -1] = -1
    return idx, targets


def shard_kernel(mixer, shard, batch: int) -> str | None:
    """The kernel the first layer's stretch ran on (attention under edge rules), planned as attend_shard plans it."""
    if not hasattr(mixer, "key_span"):
        return None
    lo, hi = mixer.key_span(shard, shard.rank)
    return mixer.shard_plan(batch, hi - lo, "cpu", lo)[0].kernel


def relative_error(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def main(argv):
    rank, world, cp, port, out = int(argv[0]), int(argv[1]), int(argv[2]), argv[3], argv[4]
    cases = argv[5].split(",")
    options = dict(a.removeprefix("--").split("=") for a in argv[6:])
    n, window = int(options["n"]), int(options["window"])
    for i, path in enumerate(filter(None, options.get("modules", "").split(","))):
        spec = importlib.util.spec_from_file_location(f"variant_{i}", REPO / path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))  # registers its mixer
    from model import GPT  # after --modules: the config takes the settings their variants declare
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # dp x cp: the processes of one group are consecutive ranks
    groups = [dist.new_group(list(range(g * cp, (g + 1) * cp))) for g in range(world // cp)]
    group = groups[rank // cp]
    results = {}
    for case in cases:
        for document_mask in [bool(int(options["documents"]))] if "documents" in options else (False, True):
            config = config_for(case, n, window)
            config.document_mask = document_mask
            torch.manual_seed(0)
            model = GPT(config)
            problems = model.context_parallel_problems()
            if problems:
                results[case] = {"refused": problems}
                break
            idx, targets = tokens(n, cp)
            torch.manual_seed(7)  # sa's permutations: one process and the group's first draw the same
            _, loss = model(idx, targets)
            loss.backward()
            expected = {name: p.grad.clone() for name, p in model.named_parameters()}
            model.zero_grad()
            if options.get("compile"):  # the shards' blocks compiled (the reference ran eagerly)
                torch._dynamo.reset()
                for block in model.blocks:
                    block.compile(backend=options["compile"])
            shard = Shard(group, rank % cp, cp, n)
            torch.manual_seed(7)
            _, sharded = model(idx, targets, shard=shard)
            sharded.backward()
            errors = {}
            for name, p in model.named_parameters():
                grad = p.grad.clone()
                dist.all_reduce(grad, group=group)  # the shards' parts of the gradient, summed
                errors[name] = relative_error(grad, expected[name])
            worst = max(errors, key=errors.get)
            traffic = {f"{label} {direction}": sent_received for (label, direction), sent_received
                       in shard.traffic.bytes.items()}
            results[f"{case}{'+documents' if document_mask else ''}"] = {
                "loss": sharded.item(), "expected_loss": loss.item(),
                "loss_error": abs(sharded.item() - loss.item()) / abs(loss.item()),
                "grad_error": errors[worst], "worst": worst, "traffic": traffic,
                "compiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                "kernel": shard_kernel(model.blocks[0].mixer, shard, idx.shape[0])}
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
