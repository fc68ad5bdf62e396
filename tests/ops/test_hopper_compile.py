"""Every span attention and MoBA kernel compiles for Hopper (sm_90a) on the CPU with Triton's bundled ptxas, in the
configurations the ops launch it with (scripts/hopper_compile.py), with packed documents and without, and its machine
code keeps to the kernels' design: no register spills, sigmoid at one special-function (MUFU) operation per score,
and loops that prefetch their rows while they compute."""

import json
import os
import subprocess
import sys

import pytest
from filelock import FileLock

from conftest import REPO
from scripts.hoppercompile.compilation import ptxas_problem
from scripts.hoppercompile.configurations import (APART_CONFIGURATION, MOBA_CONFIGURATIONS, PAIR_CONFIGURATION,
                                                  SPAN_CONFIGURATIONS)
from scripts.hoppercompile.sass import copies_in_flight, innermost_loops, loop_counts

SPAN_KERNELS = ("span_forward_kernel", "span_backward_kv_kernel", "span_backward_q_kernel")
SLOTS_KERNEL = "span_backward_kv_slots_kernel"  # sa's dk and dv (read in slots)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory, testrun_uid):
    """The rows of python -m scripts.hopper_compile: every kernel configuration, compiled once for the test run (in
    a process without TRITON_INTERPRET: the suite's processes define Triton's functions for its interpreter).
    Under xdist the workers that run these tests share it: the first compiles, the others wait for its file."""
    problem = ptxas_problem()
    if problem:
        pytest.skip(f"nothing can be compiled for Hopper on this machine: {problem}")
    out = tmp_path_factory.getbasetemp().parent / f"hopper_compile_{testrun_uid}.json"  # the workers' shared folder
    with FileLock(f"{out}.lock"):
        if not out.exists():
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            proc = subprocess.run([sys.executable, "-m", "scripts.hopper_compile", f"--json={out}"], cwd=REPO,
                                  env=env, capture_output=True, text=True, timeout=600)
            assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())["kernels"]


@pytest.mark.e2e
def test_every_span_and_moba_kernel_compiles_for_hopper_in_every_configuration(kernels):
    failed = {f"{row['kernel']} ({'; '.join(row['launched_by'])})": row["error"] for row in kernels if "error" in row}
    assert not failed, "\n\n".join(f"{name}:\n{error}" for name, error in failed.items())
    configurations = {name for row in kernels for name in row["launched_by"]}
    assert configurations == {*SPAN_CONFIGURATIONS, PAIR_CONFIGURATION, APART_CONFIGURATION, *MOBA_CONFIGURATIONS}
    assert {row["kernel"] for row in kernels} >= {*SPAN_KERNELS, "moba_choose_kernel"}
    # sa_swa's two paths apart run kernels that sa in slots and the bridges' accumulating pass compile already
    assert all(len(row["launched_by"]) > 1 for row in kernels if APART_CONFIGURATION in row["launched_by"])


@pytest.mark.e2e
def test_the_document_configurations_compile_every_kernel_in_its_document_form(kernels):
    """The spill and MUFU bounds below cover the document forms (HAS_DOCS) only if they are compiled: each kernel
    that takes documents in both forms, and exactly the document configurations launch the document forms."""
    forms = {}
    for row in kernels:
        if "HAS_DOCS" in row["constexprs"]:
            forms.setdefault(row["kernel"], set()).add(row["constexprs"]["HAS_DOCS"])
    moba_kernels = ("moba_choose_kernel", "moba_pairs_forward_kernel", "moba_pairs_dq_kernel", "moba_pairs_dkdv_kernel")
    assert forms == {kernel: {False, True} for kernel in (*SPAN_KERNELS, SLOTS_KERNEL, *moba_kernels)}
    with_documents = {name for row in kernels if row["constexprs"].get("HAS_DOCS") for name in row["launched_by"]}
    assert with_documents == ({name for name, (*_, documents) in SPAN_CONFIGURATIONS.items() if documents}
                              | {name for name, documents in MOBA_CONFIGURATIONS.items() if documents})
    ordered = [row for row in kernels if row["constexprs"].get("HAS_DOCS")
               and (row["constexprs"].get("HAS_ORDER") or row["kernel"] == SLOTS_KERNEL)]
    # sa's documents, compared in every block, in slots: each row read at its token, dk and dv summed in one kernel
    assert {row["kernel"] for row in ordered} == {"span_forward_kernel", SLOTS_KERNEL, "span_backward_q_kernel"}
    assert all(row["constexprs"].get("IN_SLOTS", True) for row in ordered)


@pytest.mark.e2e
def test_no_kernel_spills_registers(kernels):
    spilled = [(row["kernel"], row["launched_by"][0], row["registers"], row["spill_stores"], row["spill_loads"])
               for row in kernels if "error" not in row and (row["spill_stores"] or row["spill_loads"])]
    assert not spilled, f"(kernel, configuration, registers, bytes spilled, bytes reloaded): {spilled}"


@pytest.mark.e2e
def test_sigmoid_takes_at_most_one_special_function_operation_per_score(kernels):
    """1 / (1 + exp2(-s)) is two MUFU operations per score (exp2 and the reciprocal); 0.5 + 0.5 tanh(s / 2) is
    one, the bound a softmax loop's exp2 sets."""
    sigmoid = [row for row in kernels if row["constexprs"].get("SIGMOID") is True and "error" not in row]
    # the forward and both backward kernels, with documents and without
    assert {(row["kernel"], row["constexprs"]["HAS_DOCS"]) for row in sigmoid} == {
        (kernel, documents) for kernel in SPAN_KERNELS for documents in (False, True)}
    costs = {(row["kernel"], row["launched_by"][0]): row["mufu_per_score"] for row in sigmoid}  # per loop
    assert all(loops and None not in loops and max(loops) <= 1 for loops in costs.values()), f"MUFU per score: {costs}"


# sa's forward and dq in slots gather each key block at tokens read in the same iteration, so their loops wait for
# every copy; on an H100 they took 1.27x and 1.37x swa's kernels, about their instructions per key block (1.33x:
# every block masked), and pipelining them costs 18% more instructions (docs/benchmarks.md)
UNPIPELINED = {"span_forward_kernel", "span_backward_q_kernel"}


@pytest.mark.e2e
def test_every_loop_that_prefetches_rows_keeps_copies_in_flight_while_it_computes(kernels):
    """A loop whose wait leaves no cp.async group in flight loads as if it did not prefetch: its loads' latency
    adds to every iteration. sa's dk/dv and MoBA's pairs' dk/dv gather their rows at indices they read as they
    walk: read an iteration ahead, the indices leave the pipeliner a stage to prefetch the rows in."""
    waiting = [(row["kernel"], row["launched_by"][0]) for row in kernels if "error" not in row
               for loop in row["loops"] if loop["copies_in_flight"] == 0
               and not (row["kernel"] in UNPIPELINED and row["constexprs"].get("IN_SLOTS"))]
    assert not waiting, f"loops waiting for all their copies: {waiting}"
    gathering = {row["kernel"]: [loop["copies_in_flight"] for loop in row["loops"]] for row in kernels
                 if row["kernel"] in (SLOTS_KERNEL, "moba_pairs_dkdv_kernel")}
    assert len(gathering) == 2 and all(flight and min(flight) > 0 for flight in gathering.values()), gathering


def test_a_loops_copies_in_flight_are_its_tightest_wait():
    loop = ["DEPBAR.LE SB0, 0x6", "LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]", "DEPBAR.LE SB0, 0x2", "BRA `(.L_x_1)"]
    assert copies_in_flight(loop) == 2
    assert copies_in_flight(["DEPBAR.LE SB0, 0x0", "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR12], RZ, !UPT"]) == 0
    assert copies_in_flight(["WARPGROUP.DEPBAR.LE gsb0, 0x0", "FMUL R6, R6, R7"]) is None  # a wait on the MMAs


def test_the_innermost_loops_are_the_loops_that_hold_no_other():
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
.L_x_1:
        /*0020*/                   MUFU.EX2 R3, R3 ;
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR12], RZ, !UPT ;
        /*0040*/              @!P1 BRA `(.L_x_1) ;
        /*0050*/                   REDG.E.ADD.F32.FTZ.RN.STRONG.GPU desc[UR4][R4.64], R5 ;
        /*0060*/               @P0 BRA `(.L_x_0) ;
.L_x_2:
        /*0070*/                   FMUL R6, R6, R7 ;
        /*0080*/                   @P2 BRA `(.L_x_2) ;
        /*0090*/                   EXIT ;
.L_x_3:
        /*00a0*/                   BRA `(.L_x_3);
"""
    loops = innermost_loops(sass)
    assert [loop_counts(loop) for loop in loops] == [
        {"instructions": 3, "mufu": 1, "mma": 1, "atomics": 0, "copies_in_flight": None},
        {"instructions": 2, "mufu": 0, "mma": 0, "atomics": 0, "copies_in_flight": None}]
    assert loops[0][0].startswith("MUFU") and loops[0][-1].endswith("BRA `(.L_x_1)")
    outer_only = sass.replace("@!P1 BRA `(.L_x_1)", "NOP")
    assert loop_counts(innermost_loops(outer_only)[0]) == {"instructions": 6, "mufu": 1, "mma": 1, "atomics": 1,
                                                           "copies_in_flight": None}
    assert innermost_loops("/*0000*/ EXIT ;\n.L_x_9:\n/*0010*/ BRA `(.L_x_9);") == []


def test_a_sass_folder_holding_other_files_is_refused_before_anything_is_written(tmp_path):
    from config import ConfigError
    from scripts.hopper_compile import parse

    (tmp_path / "notes.txt").write_text("a user's file")
    with pytest.raises(ConfigError, match="--sass=.*holds files hopper_compile did not write"):
        parse([f"--sass={tmp_path}"])
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    assert parse([f"--sass={tmp_path / 'new'}"]).sass.endswith("new")
