"""What document masking costs: each variant's layer, forward + backward, with document_mask and without, on packed
documents of random lengths.

    python -m scripts.bench_documents                                  # every case of the registry, n = 8192
    python -m scripts.bench_documents --variants=swa,full --lengths=8192,32768 --json=out/bench_documents.json

Each case is a layer of the mixer registry (attention/registry.py: example_cases at --window), built as
scripts/bench_attention.variant_config builds it, twice with the same weights: with document_mask=True and
without. Its input is (--batch, n, heads x head_dim); the documents are runs of random lengths in
[--min_doc, --max_doc] (seeded), found as GPT.forward finds them (attention/documents.py). Every case runs in a
process of its own with one torch thread, the two settings timed in alternation (the best of --repeats runs each,
after a warm-up of both), so a ratio compares like with like. The target (docs/documents.md): "with / without" at
most --target for every case: fewer edges never cost more time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

if not __package__:  # run as a file, the project's modules cannot be imported: say how to run it
    sys.exit("run it from the repository root as a module: python -m scripts.bench_documents ...")

from attention.call import MixerCall  # noqa: E402
from attention.documents import packed_document_starts  # noqa: E402
from attention.kernels import plans_in  # noqa: E402
from attention.registry import build_mixer, example_cases, pattern_names  # noqa: E402
from common.outputs import markdown_table, write_json  # noqa: E402
from config import ConfigError, apply_args, dataclass_fields, exit_on_config_error  # noqa: E402
from scripts.bench_attention import BenchConfig as AttentionConfig  # noqa: E402
from scripts.bench_attention import variant_config  # noqa: E402


@dataclass
class BenchConfig:
    variants: str = ""  # cases of the registry, CASE:KEY=VALUE for settings; "": every case
    lengths: str = "8192"
    batch: int = 1
    heads: int = 4
    head_dim: int = 64
    window: int = 256
    min_doc: int = 200
    max_doc: int = 3000
    repeats: int = 5
    seed: int = 0
    target: float = 1.1  # the most "with / without" may be
    json: str = ""
    case: str = ""  # internal: run one "variant:n" case and print its JSON


def layer(spec: str, b: BenchConfig, n: int, document_mask: bool):
    settings = AttentionConfig(heads=b.heads, head_dim=b.head_dim, window=b.window)
    m = variant_config(spec, settings, n)
    m.document_mask, m.eot_id = document_mask, 1
    torch.manual_seed(b.seed)  # both layers get the same weights
    return build_mixer(m, m.n_layer - 1).train()


def run_case(spec: str, n: int, b: BenchConfig) -> dict:
    torch.set_num_threads(1)
    layers = {"without": layer(spec, b, n, False), "with": layer(spec, b, n, True)}
    x = torch.randn(b.batch, n, b.heads * b.head_dim, generator=torch.Generator().manual_seed(b.seed),
                    requires_grad=True)
    pos = torch.arange(n)
    docs = packed_document_starts(b.batch, n, (b.min_doc, b.max_doc), b.seed)

    def step(name):
        mixer = layers[name]
        y = mixer(x, MixerCall(pos, None, mixer.plan(b.batch, n, x.device), docs if name == "with" else None))
        y.square().mean().backward()
        x.grad = None
        for p in mixer.parameters():
            p.grad = None

    times = {name: [] for name in layers}
    for name in layers:
        step(name)  # warm-up: plans and caches built
    for _ in range(b.repeats):
        for name in layers:
            t0 = time.process_time()  # one thread: the CPU time the step took, whatever else the machine runs
            step(name)
            times[name].append(time.process_time() - t0)
    kernels = "+".join(dict.fromkeys(p.kernel for p in plans_in(layers["with"].plan(b.batch, n, x.device)))) or "own"
    ms = {name: 1000 * min(t) for name, t in times.items()}
    return {"variant": spec, "n": n, "kernel": kernels, "documents": int((docs[:, 1:] != docs[:, :-1]).sum()) + b.batch,
            "without_ms": ms["without"], "with_ms": ms["with"], "ratio": ms["with"] / ms["without"],
            "runs_ms": {name: [round(1000 * t, 1) for t in runs] for name, runs in times.items()}}


def parse(argv) -> BenchConfig:
    b = BenchConfig()
    apply_args(b, argv, dataclass_fields(BenchConfig))
    if not b.variants:  # a pattern of several mixers is its mixers' layers, each a case of its own
        b.variants = ",".join(name for name, settings in example_cases(b.window).items()
                              if len(pattern_names(settings["attn_pattern"])) == 1)
    if b.repeats < 1 or not 1 <= b.min_doc <= b.max_doc:
        raise ConfigError("repeats must be >= 1 and 1 <= min_doc <= max_doc")
    return b


def main(argv):
    b = exit_on_config_error(parse, argv)
    if b.case:
        name, _, n = b.case.rpartition(":")
        print(json.dumps(run_case(name, int(n), b)))
        return
    print(f"CPU, one torch thread per case; B={b.batch} H={b.heads} d_h={b.head_dim} window {b.window}; documents of "
          f"{b.min_doc}-{b.max_doc} tokens; torch {torch.__version__}")
    results = []
    for n in (int(x) for x in b.lengths.split(",")):
        for name in b.variants.split(","):
            proc = subprocess.run([sys.executable, "-m", "scripts.bench_documents", *argv, f"--case={name}:{n}"],
                                  capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if proc.returncode != 0:
                print(f"{name} at n={n}: failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr else ''}")
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            results.append(r)
            print(f"{name:>16} n={n:<6} {r['kernel']:>14}  without {r['without_ms']:8.1f} ms  with "
                  f"{r['with_ms']:8.1f} ms  {r['ratio']:.2f}x{'  (over ' + str(b.target) + 'x)' if r['ratio'] > b.target else ''}",
                  flush=True)
    print(markdown_table(["variant", "n", "kernel", "documents", "without ms", "with ms", "with / without"],
                         [[r["variant"], r["n"], r["kernel"], r["documents"], f"{r['without_ms']:.1f}",
                           f"{r['with_ms']:.1f}", f"{r['ratio']:.2f}"] for r in results]))
    over = [r["variant"] for r in results if r["ratio"] > b.target]
    print(f"over {b.target}x: {', '.join(over)}" if over else f"every case within {b.target}x")
    if b.json:
        write_json({"config": asdict(b), "results": results}, b.json)


if __name__ == "__main__":
    main(sys.argv[1:])
