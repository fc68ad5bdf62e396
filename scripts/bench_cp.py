"""Context parallelism per case: the bytes each process exchanges per layer against all-gathering keys and values,
the step's time at P processes against one, and the activation memory each process keeps.

    python -m scripts.bench_cp                                   # every served case, P = 4, n = 1024 and 2048
    python -m scripts.bench_cp --cases=swa,swax --P=4 --lengths=2048,4096 --json=out/bench_cp.json
    python -m scripts.bench_cp --device=cuda --P=8               # NCCL, one GPU per process

The script starts its own P processes (gloo on the CPU, NCCL on GPUs). For each case of the mixer registry that
context parallelism serves (attention/registry.py: example_cases at --window) and each length, they run one forward
and backward of a model whose sequences are cut into P shards, after one warm-up, counting what each exchange sends
and receives (attention/ops/shard.py: Traffic); process 0 also runs the model on the whole sequence alone, the
baseline. Bytes are per layer that exchanges, the most any process receives in forward (K/V fwd: keys and values,
the mean over the attention layers; widest: the widest layer's, by the exchange's plan; state fwd: a recurrence's
summaries). "n-indep" says whether they are the same at every measured length. The projection to --project_n tokens over
--project_P processes with --project_heads key/value heads of --project_head_dim in --project_bytes per element is
computed from the exchanges' own plans (the positions each process receives: attention/ops/shard.py
received_positions; a recurrence's summary measured per head, which no length changes), and at every measured
length the counters are checked against the same plans. Memory: the bytes autograd keeps for backward (each saved
storage once): the activations, at P against one process. On a machine with fewer cores than P processes the times
share the cores (said in the table).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as a file, the project's modules cannot be imported: say how to run it
    sys.exit("run it from the repository root as a module: python -m scripts.bench_cp ...")

from attention.layer import Attention  # noqa: E402
from attention.ops.shard import Shard  # noqa: E402
from attention.registry import MIXERS, example_cases, pattern_names  # noqa: E402
from common.outputs import write_json  # noqa: E402
from config import ModelConfig  # noqa: E402
from model import GPT  # noqa: E402


def served_cases(window: int) -> list[str]:
    cases = example_cases(window)
    return [c for c in cases if all(MIXERS[m].context_parallel for m in pattern_names(cases[c]["attn_pattern"]))]


def model_for(case: str, n: int, args) -> GPT:
    torch.manual_seed(0)
    settings = {"arch": "llama", "n_layer": args.layers, "n_head": args.heads, "n_embd": args.heads * args.head_dim,
                "block_size": n, "vocab_size": 256, "bias": False, **example_cases(args.window)[case]}
    return GPT(ModelConfig(**settings))  # a case may set its own depth (mswa's schedule)


def saved_bytes(run, parameters) -> tuple:
    """(run()'s loss, the bytes autograd keeps for backward while run() builds the graph): each storage once, the
    parameters' left out (every process holds them whole)."""
    seen, weights = {}, {p.untyped_storage().data_ptr() for p in parameters}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage().data_ptr() not in weights:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run()
    return loss, sum(seen.values())


def step(model, idx, targets, shard=None):
    """One forward and backward: (seconds, activation bytes)."""
    start = time.perf_counter()
    loss, kept = saved_bytes(lambda: model(idx, targets, **({"shard": shard} if shard else {}))[1],
                             model.parameters())
    loss.backward()
    if idx.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, kept


def planned_positions(model: GPT, shard: Shard) -> list[int]:
    """The positions this process receives in each layer that receives keys, by the layer's plan."""
    received = [b.mixer.context_parallel_received(shard) for b in model.blocks]
    return [r for b, r in zip(model.blocks, received) if isinstance(b.mixer, Attention)]


def worker(rank: int, args) -> None:
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=args.P)
    rows = []
    for case in args.cases.split(","):
        for n in [int(x) for x in args.lengths.split(",")]:
            model = model_for(case, n, args).to(device)
            g = torch.Generator().manual_seed(n)
            idx = torch.randint(0, 256, (args.batch, n), generator=g).to(device)
            targets = torch.randint(0, 256, (args.batch, n), generator=g).to(device)
            shard = Shard(None, rank, args.P, n)
            step(model, idx, targets, shard)  # warm-up
            model.zero_grad()
            shard.traffic.clear()
            dist.barrier()
            seconds, kept = step(model, idx, targets, shard)
            dist.barrier()
            row = {"case": case, "n": n, "rank": rank, "seconds": seconds, "activation_bytes": kept,
                   "traffic": {f"{label}|{direction}": [*sent_received, shard.traffic.calls[(label, direction)]]
                               for (label, direction), sent_received in shard.traffic.bytes.items()},
                   "planned_positions": planned_positions(model, shard)}
            if rank == 0:  # the baseline: the whole sequence in one process, the others waiting
                model.zero_grad()
                step(model, idx, targets)
                model.zero_grad()
                row["whole_seconds"], row["whole_activation_bytes"] = step(model, idx, targets)
            dist.barrier()
            rows.append(row)
    gathered = [None] * args.P
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        Path(args.out).write_text(json.dumps([r for rs in gathered for r in rs]))
    dist.destroy_process_group()


def summarise(rows: list[dict], args) -> list[dict]:
    """One row per (case, length): the largest per-layer bytes over the processes, time and memory."""
    kv_per_position = 2 * args.batch * args.heads * args.head_dim * 4  # float32 keys and values, all heads
    table = []
    for (case, n) in dict.fromkeys((r["case"], r["n"]) for r in rows):
        ranks = [r for r in rows if r["case"] == case and r["n"] == n]
        per_layer = {}
        for r in ranks:
            for key, (sent, received, calls) in r["traffic"].items():
                label, direction = key.split("|")
                moved = received if direction == "forward" else sent
                per_layer[(label, direction)] = max(per_layer.get((label, direction), 0), moved // max(calls, 1))
        base = next(r for r in ranks if r["rank"] == 0)
        # the plan's bytes: every attention layer's on every process against what the exchanges counted, and the
        # widest layer's on the process that receives most (what the bound is about)
        planned_total = {r["rank"]: sum(r["planned_positions"]) * kv_per_position for r in ranks}
        counted_total = {r["rank"]: r["traffic"].get("keys and values|forward", [0, 0])[1] for r in ranks}
        widest = max(max(r["planned_positions"], default=0) for r in ranks) * kv_per_position
        table.append({"case": case, "n": n, "P": args.P,
                      "bytes_per_layer": {f"{label} {direction}": v for (label, direction), v in per_layer.items()},
                      "kv_forward_bytes": per_layer.get(("keys and values", "forward"), 0),
                      "kv_widest_layer_bytes": widest, "kv_counted_as_planned": planned_total == counted_total,
                      "all_gather_bytes": (n - n // args.P) * kv_per_position,
                      "state_forward_bytes": per_layer.get(("recurrent state", "forward"), 0),
                      "seconds": max(r["seconds"] for r in ranks), "whole_seconds": base["whole_seconds"],
                      "activation_bytes": max(r["activation_bytes"] for r in ranks),
                      "whole_activation_bytes": base["whole_activation_bytes"]})
    for row in table:  # the same bytes at every length: independent of n
        same_case = [r for r in table if r["case"] == row["case"]]
        row["n_independent"] = len({(r["kv_forward_bytes"], r["state_forward_bytes"]) for r in same_case}) == 1
    return table


def projection(case: str, row: dict, args) -> dict:
    """Bytes per layer per process at --project_n over --project_P, from the exchange plans."""
    n, P = args.project_n, args.project_P
    model = model_for(case, args.window * 4, args)  # the rules alone: their layers at any length
    positions = max(b.mixer.context_parallel_received(Shard(None, r, P, n)) for r in range(P) for b in model.blocks)
    kv = 2 * args.project_heads * args.project_head_dim * args.project_bytes
    per_summary_head = row["state_forward_bytes"] / max(args.P - 1, 1) / (args.batch * args.heads)
    return {"kv_bytes": positions * kv, "state_bytes": per_summary_head * args.project_heads * (P - 1),
            "all_gather_bytes": (n - n // P) * kv}


def mib(b) -> str:
    return f"{b / 2**20:9.3f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--cases", default="", help="registry cases (default: every one context parallelism serves)")
    parser.add_argument("--P", type=int, default=4, help="processes per sequence")
    parser.add_argument("--lengths", default="1024,2048", help="sequence lengths, each divisible by P")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--project_n", type=int, default=131072)
    parser.add_argument("--project_P", type=int, default=8)
    parser.add_argument("--project_heads", type=int, default=16)
    parser.add_argument("--project_head_dim", type=int, default=64)
    parser.add_argument("--project_bytes", type=int, default=2, help="bytes per element of keys and values (bf16: 2)")
    parser.add_argument("--json", default="", help="write the table and the runs here")
    parser.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.cases = args.cases or ",".join(served_cases(args.window))
    if args.worker >= 0:
        return worker(args.worker, args)
    unserved = [c for c in args.cases.split(",") if c not in served_cases(args.window)]
    bad = [n for n in map(int, args.lengths.split(",")) if n % args.P]
    if unserved or bad:
        sys.exit(f"error: {'cases ' + ', '.join(unserved) + ' are not served by context parallelism' if unserved else ''}"
                 f"{'; ' if unserved and bad else ''}{'lengths ' + ', '.join(map(str, bad)) + f' not divisible by P={args.P}' if bad else ''}")
    scratch = tempfile.TemporaryDirectory()  # the processes' rows, read back and removed with it
    out = Path(scratch.name) / "runs.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "scripts.bench_cp", *(argv if argv is not None else sys.argv[1:]),
                               f"--worker={r}", f"--out={out}", f"--cases={args.cases}"], env=env)
             for r in range(args.P)]
    if any(p.wait() for p in procs):
        sys.exit("error: a process of the benchmark failed (its traceback is above)")
    rows = json.loads(out.read_text())
    scratch.cleanup()
    table = summarise(rows, args)
    cores = os.cpu_count()
    print(f"context parallelism: P={args.P} processes ({args.device}{f', {cores} cores' if args.device == 'cpu' else ''}), "
          f"B={args.batch}, {args.layers} layers x {args.heads} heads x {args.head_dim}, window {args.window}, float32; "
          f"bytes per layer per process (MiB)")
    print(f"{'case':<18}{'n':>7}{'K/V fwd':>10}{'widest':>10}{'all-gather':>11}{'state fwd':>10}{'n-indep':>8}"
          f"{'ms at P':>9}{'ms at 1':>9}{'act. at P':>10}{'/ at 1':>8}")
    for r in table:
        print(f"{r['case']:<18}{r['n']:>7}{mib(r['kv_forward_bytes'])}{mib(r['kv_widest_layer_bytes'])} "
              f"{mib(r['all_gather_bytes'])}{mib(r['state_forward_bytes'])}{'yes' if r['n_independent'] else 'no':>8}"
              f"{1e3 * r['seconds']:9.1f}{1e3 * r['whole_seconds']:9.1f}{mib(r['activation_bytes'])} "
              f"{r['activation_bytes'] / r['whole_activation_bytes']:7.2f}x")
    if args.device == "cpu" and cores < args.P:
        print(f"note: {args.P} processes share {cores} cores: the times at P are not what P machines take")
    mismatch = [f"{r['case']} n={r['n']}" for r in table if not r["kv_counted_as_planned"]]
    if mismatch:
        sys.exit(f"error: the measured key/value bytes differ from the exchange plan for {', '.join(mismatch)}")
    print(f"\nprojected to n={args.project_n:,} over P={args.project_P}, {args.project_heads} heads x "
          f"{args.project_head_dim}, {args.project_bytes} bytes per element (MiB per layer per process)")
    print(f"{'case':<18}{'K/V':>10}{'state':>10}{'all-gather':>11}")
    projected = {}
    for r in table:
        if r["case"] not in projected:
            projected[r["case"]] = p = projection(r["case"], r, args)
            print(f"{r['case']:<18}{mib(p['kv_bytes'])}{mib(p['state_bytes'])} {mib(p['all_gather_bytes'])}")
    if args.json:
        write_json({"args": vars(args), "table": table, "projected": projected, "cores": cores}, Path(args.json))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
