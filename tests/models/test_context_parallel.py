"""Context parallelism against one process: every case of the mixer registry, its sequence cut into P shards on
gloo processes (tests/models/cp_worker.py), gives one process's loss and every parameter's gradient, with and
without packed documents whose boundaries fall at a shard's start and one token before another's, and with a
window longer than a shard; a case whose mixers declare no context-parallel form is refused in one line. The bytes
each process receives are the rule's halo and the recurrences' summaries, counted by the exchanges."""

import json
import socket
import subprocess
import sys

import pytest

from attention.registry import MIXERS, example_cases, pattern_names
from conftest import REPO

N, WINDOW = 96, 32  # shards of 48, 32 and 24 tokens: the window is longer than a shard at P = 4
CASES = example_cases(WINDOW)
TOLERANCE = 1e-5  # relative, float32
LAYERS, BATCH, HEADS, HEAD_DIM = 2, 2, 4, 8  # cp_worker's models: n_embd 32 over 4 heads


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(tmp_path, world: int, cp: int, cases, modules=(), compile_backend="", *options) -> list[dict]:
    out, port = tmp_path / "results.json", str(free_port())
    procs = [subprocess.Popen([sys.executable, "tests/models/cp_worker.py", str(rank), str(world), str(cp), port,
                               str(out), ",".join(cases), f"--n={N}", f"--window={WINDOW}",
                               f"--modules={','.join(modules)}", f"--compile={compile_backend}", *options],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return json.loads(out.read_text())


def serves(case: str) -> bool:
    return all(MIXERS[name].context_parallel for name in pattern_names(CASES[case]["attn_pattern"]))


@pytest.mark.e2e
@pytest.mark.parametrize("world, cp", [(3, 3), (4, 4), (4, 2)], ids=["cp3", "cp4", "dp2xcp2"])
def test_every_case_equals_one_process_or_is_refused(tmp_path, world, cp):
    # dp 2 x cp 2: two groups of two, each its own sequence's shards (P = 2 within each). Packed documents at
    # every P; without them (one stream) at P = 3
    documents = () if cp == 3 else ("--documents=1",)
    results = run_group(tmp_path, world, cp, sorted(CASES), (), "", *documents)
    for rank, by_case in enumerate(results):
        for case in CASES:
            if not serves(case):
                refusal = by_case[case]["refused"]
                assert len(refusal) == 1 and "no context-parallel form" in refusal[0], (case, refusal)
                continue
            for name in (case, f"{case}+documents") if cp == 3 else (f"{case}+documents",):
                r = by_case[name]
                assert r["loss_error"] <= TOLERANCE, (rank, name, r)
                assert r["grad_error"] <= TOLERANCE, (rank, name, r)
        if cp == 4:
            check_bytes(rank, by_case)
    # the refusals follow what the mixers declare; most cases are served
    assert sum(serves(case) for case in CASES) >= len(CASES) - 3


def check_bytes(rank: int, by_case: dict) -> None:
    """A window's shard receives its halo and a recurrence's one summary from each other process."""
    shard = N // 4
    traffic = by_case["swa+documents"]["traffic"]  # documents change what is masked, not what travels
    # keys and values of the w - 1 positions before the shard (fewer where the sequence begins), from one or
    # (the window longer than a shard) two processes; as many go back in backward as gradients
    halo = min(WINDOW - 1, rank * shard)
    per_position = 2 * BATCH * HEADS * HEAD_DIM * 4
    sent_forward, received_forward = traffic.get("keys and values forward", [0, 0])
    sent_backward, received_backward = traffic.get("keys and values backward", [0, 0])
    assert received_forward == LAYERS * halo * per_position, (rank, traffic)
    assert sent_backward == received_forward and received_backward == sent_forward
    # the Taylor state: (1 + f + f^2) features x (head_dim + 1) values and the log decay, per head, from each
    # other process, whatever the length
    features = 1 + 16 + 16 ** 2
    summary = BATCH * HEADS * (features * (HEAD_DIM + 1) + 1) * 4
    sent, received = by_case["linear+documents"]["traffic"]["recurrent state forward"]
    assert received == LAYERS * 3 * summary, (rank, by_case["linear+documents"]["traffic"])


@pytest.mark.e2e
def test_a_rule_and_a_recurrent_mixer_each_written_in_one_file_get_their_exchange(tmp_path):
    # docs/adding_a_variant.md's two examples, registered from their own files: the rule's halo comes from its
    # allowed() and key_ranges, the recurrence's state from the core, with nothing else written for them
    results = run_group(tmp_path, 3, 3, ["dilated_window", "retention"],
                        modules=["examples/dilated_window.py", "examples/retention.py"])
    for rank, by_case in enumerate(results):
        for name in ("dilated_window", "dilated_window+documents", "retention", "retention+documents"):
            r = by_case[name]
            assert r["loss_error"] <= TOLERANCE and r["grad_error"] <= TOLERANCE, (rank, name, r)
        assert by_case["dilated_window"]["traffic"]["keys and values forward"][1] > 0 or rank == 0
        assert by_case["retention"]["traffic"]["recurrent state forward"][1] > 0


@pytest.mark.e2e
def test_compiled_blocks_break_around_the_exchanges_and_equal_one_process(tmp_path):
    # train.py's compile: each block compiled on its own (aot_eager here: Dynamo and AOTAutograd, inductor's first
    # half), the halo's sends, the summaries' gather and the shard's plan left out of the graphs
    results = run_group(tmp_path, 2, 2, ["swa", "linear"], (), "aot_eager", "--documents=1")
    for rank, by_case in enumerate(results):
        assert set(by_case) == {"swa+documents", "linear+documents"}
        for name, r in by_case.items():
            assert r["loss_error"] <= TOLERANCE and r["grad_error"] <= TOLERANCE, (rank, name, r)
            assert r["compiled_graphs"] >= 2, r  # the blocks did compile, in pieces around the exchanges


def test_a_rule_that_reaches_every_earlier_key_says_it_falls_back_to_all_of_them():
    from attention.ops.shard import Shard
    from config import ModelConfig
    from model import GPT

    def exchange(pattern, **extra):
        model = GPT(ModelConfig(arch="llama", n_layer=1, n_head=4, n_embd=32, block_size=N, vocab_size=64,
                                attn_pattern=pattern, **extra))
        return model.blocks[0].mixer.context_parallel_exchange(Shard(None, 0, 4, N), 2)
    # the last of 4 processes receives the 72 positions before its shard: every earlier one, 72 x 2 x 4 x 8 x 2 bytes
    assert exchange("full").startswith("72 positions' keys and values (0.00879 MiB per sequence): every position")
    assert exchange("swa", swa_window=WINDOW) == "31 positions' keys and values (0.00378 MiB per sequence)"
    # the heads that travel: grouped-query keys as they are for a rule's kernels, repeated per query head for sa's
    assert exchange("full", n_kv_head=2).startswith("72 positions' keys and values (0.00439 MiB per sequence)")
    assert exchange("sa", swa_window=WINDOW, n_kv_head=2).startswith("72 positions' keys and values (0.00879 MiB")


@pytest.mark.e2e
@pytest.mark.gpu_sim
def test_the_cuda_paths_kernels_take_the_halo_at_its_offset(tmp_path, monkeypatch):
    # the kernels a GPU runs (span attention's, FlexAttention's), planned at the stretch's first position: the
    # shards of the simulated CUDA path (attention/simulate_cuda.py) equal one process there too
    from attention import simulate_cuda

    monkeypatch.setenv(simulate_cuda.ENV, "1")
    results = run_group(tmp_path, 2, 2, ["swa", "bridge", "mswa", "swat"], (), "", "--documents=1")
    for rank, by_case in enumerate(results):
        for name, r in by_case.items():
            assert r["loss_error"] <= TOLERANCE and r["grad_error"] <= TOLERANCE, (rank, name, r)
            assert r["kernel"] in ("span", "flex"), (name, r["kernel"])  # not the CPU's chunked kernel
