"""Paper 004's coverage theory from the edge rules: the closed forms of Sec. 3.5-3.6 for every (d, r),
Propositions 2 and 4, and Theorem 2's boundary-copy bound on trained models."""

import math

import pytest
import torch

from attention.bridge import BoundaryWindows
from attention.edges import FixedBlock
from conftest import run_in_process
from eval.coverage import (all_depth_coverage, closed_form, direct_coverage, pre_boundary_write_back_adds_no_source,
                           report, rules)
from scripts.bridges.boundary_copy import run


def test_coverage_from_the_masks_equals_the_closed_forms_at_the_papers_setting():
    out = report(block=128, width=128, extension=64, depth=3)  # b = 128, h = 64, e = 64; d = 0 .. 320
    assert all(check["equals_closed_form"] for check in out["variants"].values()), out["variants"]
    cells = {name: check["covered_cells"] for name, check in out["variants"].items()}
    assert cells == {"block": 8_256, "swa": 16_384, "bridge": 12_352, "pbb": 12_352, "se_bridge": 16_448}
    assert out["proposition_2_pre_boundary_write_back_adds_no_source"]
    assert out["proposition_4_swa_se_not_nested"]
    assert out["swa_not_se_witness_d_r"] == (65, 64) and out["se_not_swa_witness_d_r"] == (128, 0)
    assert out["pbb_coverage_inside_se"]  # with e = h, SE-Bridge strictly contains PBB's coverage


@pytest.mark.parametrize("block, width, extension", [(16, 16, 8), (16, 8, 12), (32, 48, 5)])
def test_closed_forms_hold_for_other_settings(block, width, extension):
    max_distance = 2 * block + extension
    context = (max_distance // block + 3) * block
    for variant, rule in rules(block, min(width, block), extension, context).items():
        if variant == "swa":
            continue
        measured = direct_coverage(rule, block, max_distance)
        assert torch.equal(measured, closed_form(variant, block, min(width, block), extension, max_distance)), variant


def test_block_coverage_does_not_grow_with_depth_but_swa_does():
    block_rule, swa_rule = FixedBlock(16), rules(16, 16, 8, 128)["swa"]
    one, four = (all_depth_coverage(block_rule, 16, 40, depth) for depth in (1, 4))
    assert torch.equal(one, four) and torch.equal(four, closed_form("block", 16, 16, 8, 40))  # Proposition 1
    assert all_depth_coverage(swa_rule, 16, 40, 2).sum() > direct_coverage(swa_rule, 16, 40).sum()


def test_proposition_2_would_fail_for_a_write_back_that_adds_sources():
    assert pre_boundary_write_back_adds_no_source(16, 16, 128)
    # the check is not vacuous: se_bridge's sources reach a whole block back, past the target's own block
    se = BoundaryWindows("se_bridge", 16, 8, 128).dense_mask(torch.arange(128))
    assert (se & ~FixedBlock(16).dense_mask(torch.arange(128))).any()


def test_the_boundary_copy_bound_holds_for_block_and_the_repairs_learn_it():
    K = 4
    block = run("block", K=K, steps=150)
    assert block["max_logit_change_across_labels"] == 0  # Lemma 1: h_p is the same whatever x_{p-1}
    assert block["accuracy"] <= 1 / K + 1e-12 and block["loss"] >= math.log(K) - 1e-9  # Theorem 2, Eq. 12-13
    for pattern in ("pbb", "se_bridge", "swa"):
        repaired = run(pattern, K=K, steps=150)
        assert repaired["accuracy"] > 0.9 and repaired["loss"] < 0.5 * math.log(K), repaired


@pytest.mark.e2e
def test_coverage_command_runs():
    proc = run_in_process(["-m", "eval.coverage"], "--block", "32", "--width", "32", "--extension", "16")
    assert proc.returncode == 0, proc.stderr
    assert "Proposition 4 (SWA and SE-Bridge not nested): True" in proc.stdout
