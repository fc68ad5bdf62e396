"""Every entry point answers --help with its options and exits 0: the typed-config ones (config.apply_args)
list every field as --name=TYPE with its default and the comment the config writes for it."""

from pathlib import Path

import pytest

from config import Config, dataclass_fields, field_help, options_text
from conftest import REPO, run_in_process

# every module under scripts/ is a command line, but for the libraries of the GPU check, the GPU benchmark and the
# Hopper compile report (scripts/gpu_check.py, scripts/gpu_bench.py and scripts/hopper_compile.py are their commands)
LIBRARIES = ("gpucheck", "gpubench", "hoppercompile")
SCRIPTS = sorted("scripts." + ".".join(p.relative_to(REPO / "scripts").with_suffix("").parts)
                 for p in Path(REPO, "scripts").rglob("*.py")
                 if p.stem != "__init__" and not set(LIBRARIES) & set(p.relative_to(REPO / "scripts").parts))
ENTRY_POINTS = [["train.py"], ["sample.py"], ["export.py"], ["-m", "eval"], ["-m", "eval.coverage"],
                ["-m", "data.prepare"], *(["-m", script] for script in SCRIPTS)]


def test_the_options_list_every_field_with_its_default_and_its_comment():
    text = options_text(Config())
    for line in ("  --arch=str (default 'gpt2')", "  --swa_window=int (default 256)", "\ntrain:", "\neval:"):
        assert line in text
    helps = field_help(type(Config().train))
    assert helps["grad_clip"] == "0 disables clipping"  # its own comment
    assert helps["init_from"].startswith("scratch | resume | gpt2")  # the comment lines above it
    assert "key/value heads" in field_help(type(Config().model))["n_kv_head"]  # a section's heading is not its help
    assert not field_help(type(Config().model))["n_kv_head"].startswith("attention shapes")
    assert field_help(type(Config().model))["swa_window"].startswith("swa(w)")  # a variant Setting's help


@pytest.mark.e2e
def test_every_entry_point_prints_its_options_on_help():
    # each as `python SCRIPT --help` or `python -m MODULE --help` runs it, in this process (run_in_process)
    results = {" ".join(entry): run_in_process(entry, "--help") for entry in ENTRY_POINTS}
    for entry, proc in results.items():
        assert proc.returncode == 0 and proc.stdout.strip(), (entry, proc.returncode, proc.stdout[:500],
                                                              proc.stderr[-500:])
        assert entry == "-m scripts.variants" or "usage" in proc.stdout.lower(), entry
    for key in dataclass_fields(type(Config().train)):
        assert f"--{key}=" in results["train.py"].stdout
    sample = results["sample.py"].stdout
    assert "--temperature=float (default 0.8)" in sample and "0: greedy" in sample
    assert results["-m eval"].stdout.startswith("usage: python -m eval")


def test_a_comment_continued_on_the_lines_below_its_field_is_the_whole_help():
    """A field's comment carried on indented comment lines under it is one help text (eval's ppl_stream was cut
    at its first line); a comment line at the block's own indentation heads the next section and is not joined."""
    from eval.__main__ import EvalRunConfig

    helps = field_help(EvalRunConfig)
    assert helps["ppl_stream"].endswith("instead of document by document: lengths beyond the documents")
    assert "niah" not in helps["ppl_stream"] and helps["niah_lengths"] == "default: the run's block_size"
