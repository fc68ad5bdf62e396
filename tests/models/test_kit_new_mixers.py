"""A mixer added as one file gets the whole conformance kit with no test edited: in a copy of the repository, a
recurrent mixer on the recurrence core (examples/retention.py, RetNet's multi-scale retention) and an edge rule
written as allowed() alone (examples/dilated_window.py) are dropped into attention/, and `pytest -k NAME` over the
kit's two files (tests/models/test_conformance.py, tests/models/test_gpu_sim.py) runs every check of the kit for
each of them, and every one passes."""

import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import pytest

from attention.registry import example_cases
from conftest import REPO

KIT = ["tests/models/test_conformance.py", "tests/models/test_gpu_sim.py"]
NEW = {"retention": "examples/retention.py", "dilated_window": "examples/dilated_window.py"}


def kit_checks(names: list[str], case: str) -> set[str]:
    """The kit's test functions that ran for a case: those whose id names it as its parameter."""
    return {name.split("[")[0] for name in names if f"[{case}]" in name or f"[{case}-" in name or f"-{case}]" in name}


@pytest.mark.e2e
def test_a_new_recurrent_mixer_and_a_new_rule_each_run_through_the_whole_kit(tmp_path):
    copy = tmp_path / "repo"
    ignore = shutil.ignore_patterns(".git", "out", "wandb", "__pycache__", "*.bin", "meta.json", ".tmp*", ".pytest_cache")
    shutil.copytree(REPO, copy, ignore=ignore)
    for name, source in NEW.items():
        shutil.copy(REPO / source, copy / "attention" / f"{name}.py")
    for path in KIT:  # the kit as it is: nothing edited for the new mixers
        assert (copy / path).read_bytes() == (REPO / path).read_bytes()
    report = tmp_path / "kit.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", " or ".join(NEW),
                           f"--junitxml={report}", *KIT], cwd=copy, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    cases = ElementTree.parse(report).getroot().iter("testcase")
    ran = [case.get("name") for case in cases if not list(case)]  # passed: no failure, error or skip element
    # the checks every case of this repository's registry gets, each run for each new mixer too
    ids = collected_ids()
    every_case = set.intersection(*(kit_checks(ids, case) for case in example_cases(32)))
    assert len(every_case) >= 10, sorted(every_case)
    for name in NEW:
        assert kit_checks(ran, name) >= every_case, (name, sorted(every_case - kit_checks(ran, name)))


def collected_ids() -> list[str]:
    """The kit's test ids in this repository, as pytest collects them."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *KIT],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:]
    return [line.split("::", 1)[1] for line in proc.stdout.splitlines() if "::" in line]
