import subprocess
import sys

import pytest
import torch

from config import Config, ConfigError, load_config
from conftest import REPO


def test_file_then_overrides_with_types(tmp_path):
    path = tmp_path / "c.py"
    path.write_text("import math\nn_layer = 3\nlearning_rate = 1e-3\nbeta1, beta2 = 0.8, 0.9\n_private = 'x'\n")
    cfg = load_config([str(path), "--learning_rate=3e-4", "--compile=True", "--max_iters=1e3", "--out_dir=x"])
    assert cfg.model.n_layer == 3 and cfg.train.beta1 == 0.8 and cfg.train.beta2 == 0.9
    assert cfg.train.learning_rate == 3e-4 and cfg.train.compile is True
    assert cfg.train.max_iters == 1000 and isinstance(cfg.train.max_iters, int)
    assert cfg.train.out_dir == "x"


@pytest.mark.parametrize("args, expected", [
    (["--max_iter=5"], "did you mean 'max_iters'"),
    (["--max_iters=abc"], "expected int"),
    (["--compile=maybe"], "expected a boolean"),
    (["--learning_rate=fast"], "expected float"),
    (["--arch=gpt3"], "expected one of 'gpt2', 'llama'"),
    (["--n_embd=100", "--n_head=3"], "not divisible"),
    (["--attn_pattern=ful"], "did you mean 'full'"),
    (["--n_layer=3", "--attn_pattern=full,full"], "does not divide n_layer"),
    (["max_iters=5"], "cannot read config file"),
    (["--init_from=resume", "--replace_run=True"], "pass one of them"),
])
def test_bad_values_name_the_problem(args, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(args)


def test_config_file_with_bad_key_or_type(tmp_path):
    path = tmp_path / "c.py"
    path.write_text("n_layers = 4\n")
    with pytest.raises(ConfigError, match="did you mean 'n_layer'"):
        load_config([str(path)])
    path.write_text("max_iters = '100'\n")
    with pytest.raises(ConfigError, match="expected int"):
        load_config([str(path)])


def test_roundtrip_through_dict():
    cfg = load_config(["configs/quickstart.py", "--n_layer=2"])
    again = Config.from_dict(cfg.to_dict())
    assert again == cfg


@pytest.mark.e2e
@pytest.mark.parametrize("override", ["--no_such_key=1", "--max_iters=abc"])
def test_train_exits_2_and_writes_nothing(tmp_path, override):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "train.py", "configs/quickstart.py", f"--out_dir={out}", override],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "config error" in proc.stderr and override.split("=")[0][2:] in proc.stderr
    assert not out.exists()


def test_include_applies_another_file_first(tmp_path):
    base = tmp_path / "base.py"
    base.write_text("n_layer = 3\nlearning_rate = 1e-3\n")
    child = tmp_path / "child.py"
    child.write_text(f"include({str(base)!r})\nlearning_rate = 5e-4\n")
    cfg = load_config([str(child), "--max_iters=7"])
    assert cfg.model.n_layer == 3 and cfg.train.learning_rate == 5e-4 and cfg.train.max_iters == 7
    child.write_text("include('no/such/file.py')\n")
    with pytest.raises(ConfigError, match="cannot read config file no/such/file.py"):
        load_config([str(child)])


def test_a_saved_config_json_loads_and_a_bad_one_is_named(tmp_path):
    import json

    cfg = load_config(["configs/quickstart.py", "--n_layer=3", "--parallelism=fsdp"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**cfg.to_dict(), "run": {"git_hash": "x"}, "data_meta": {"vocab_size": 257}}))
    again = load_config([str(path), "--max_iters=7"])
    assert again.model == cfg.model and again.train.parallelism == "fsdp" and again.train.max_iters == 7
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config([str(path)])
    path.write_text(json.dumps({"model": {"n_layers": 2}}))
    with pytest.raises(ConfigError, match="n_layers"):
        load_config([str(path)])


def test_every_config_path_the_docs_name_exists():
    """README.md, docs/ and the per-paper READMEs name configs (with {a,b} alternatives and globs): each exists."""
    import glob
    import itertools
    import re

    from conftest import REPO

    texts = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "configs").glob("*/README.md")]
    named = set()
    for path in texts:
        text = path.read_text()
        folder = path.parent.relative_to(REPO).as_posix() if path.name == "README.md" and path.parent.name != REPO.name \
            else None
        names = re.findall(r"configs/[\w/.*{},\[\]-]+?\.py", text)
        if folder:  # a folder README names its own files bare: `name.py`, `prefix_{a,b}.py`
            names += [f"{folder}/{n}" for n in re.findall(r"`([\w.*{},\[\]-]+?\.py)`", text)]
        named.update(names)
    assert len(named) > 40
    missing = []
    for name in sorted(named):
        parts = re.split(r"\{([^}]*)\}", name)
        choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
        for combo in itertools.product(*choices):
            expanded = "".join(combo)
            if not glob.glob(str(REPO / expanded)):
                missing.append(expanded)
    assert not missing, missing


def test_the_readme_variant_table_is_the_registrys():
    from conftest import load_script

    table = load_script("variants").variants_table()
    readme = (REPO / "README.md").read_text()
    assert table in readme, "README.md's variant table differs from the registry's: run python -m scripts.variants --write"
    from attention.registry import MIXERS

    # every documented variant (one with a summary) is in the table; one being written, without, is left out (a
    # new variant edits no other file: tests/layers/test_new_variant.py runs this test with one added)
    assert all(f"`{name}`" in table for name, cls in MIXERS.items() if cls.summary)


def test_the_variant_table_writer_replaces_only_the_table():
    from conftest import load_script

    variants = load_script("variants")
    text = f"# title\n\n{variants.MARKER}\n| a | b |\n|---|---|\n| old | row |\n\nafter the table\n"
    written = variants.readme_with_table(text, "| a | b |\n|---|---|\n| new | row |")
    assert written == f"# title\n\n{variants.MARKER}\n| a | b |\n|---|---|\n| new | row |\n\nafter the table\n"
    assert variants.readme_with_table(written, "| a | b |\n|---|---|\n| new | row |") == written


def test_the_readme_is_short_and_every_path_and_command_in_the_docs_exists():
    """README.md stays a ten-minute read (at most 320 lines), and every file path, local link and `python ...`
    command that README.md and docs/ name exists: scripts and modules by their path, files by theirs."""
    import importlib.util
    import re

    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 320
    texts = {path: path.read_text() for path in [REPO / "README.md", *(REPO / "docs").glob("*.md")]}
    missing, commands = [], 0
    for path, text in texts.items():
        for script in re.findall(r"python (?:-c \S+ )?((?:scripts|data|eval)/\w+\.py|train\.py|sample\.py|export\.py)", text):
            commands += 1
            if not (REPO / script).is_file():
                missing.append((path.name, script))
        for module in re.findall(r"python -m ([\w.]+)", text):
            commands += 1
            if module not in ("pytest", "torch.distributed.run") and importlib.util.find_spec(module) is None:
                missing.append((path.name, module))
        # repository paths in backticks (a file with an extension, in a folder of the repository)
        for name in re.findall(r"`((?:attention|scripts|eval|data|tests|docs|configs|\.ci)/[\w./-]+\.(?:py|md|txt))`",
                               text):
            if "*" not in name and "{" not in name and not (REPO / name).exists():
                missing.append((path.name, name))
        for link, anchor in re.findall(r"\]\(([^)#:]*?\.(?:md|png|py|txt))?(?:#([\w-]*))?\)", text):  # local links
            target = path.parent / link if link else path
            if link and not target.exists():
                missing.append((path.name, link))
            elif anchor and target.suffix == ".md" and anchor not in heading_anchors(target.read_text()):
                missing.append((path.name, f"{link}#{anchor}"))
    assert commands > 50 and not missing, missing


def heading_anchors(markdown: str) -> set:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation but - and _ dropped, spaces to -."""
    import re

    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", markdown, re.M):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return anchors


def test_the_readme_names_the_libraries_its_install_command_installs():
    """The quick start's first command installs requirements.txt: the README names each library it pulls in."""
    import re

    readme = (REPO / "README.md").read_text()
    install = readme.split("The first command installs", 1)[1].split("The second", 1)[0]
    for line in (REPO / "requirements.txt").read_text().splitlines():
        name = re.split(r"[<>=\s#]", line.strip(), maxsplit=1)[0]
        if name and name not in ("torch", "pytest-xdist"):
            assert name in install, f"README's install paragraph does not name {name}"


def test_a_training_process_gets_a_cuda_device_with_an_index():
    # torch.cuda.set_device refuses a bare "cuda" (a first GPU run of train.py met it): each process's own GPU.
    # torch's own check (the one set_device runs) takes the device on the CPU too
    from torch.cuda._utils import _get_device_index

    from config import process_device

    assert _get_device_index(process_device("cuda")) == 0
    assert _get_device_index(process_device("cuda", local_rank=3)) == 3
    assert process_device("cuda:1", local_rank=3) == torch.device("cuda", 1)  # an index given stays
    assert process_device("cpu", local_rank=3) == torch.device("cpu")
    with pytest.raises(ValueError, match="specified index"):  # what train.py passed before
        _get_device_index(torch.device("cuda"))


def test_one_command_line_dialect_for_every_entry_point():
    # --key=value, --key value, a boolean's bare --key, and (for tools taking a list) positional items
    from dataclasses import dataclass

    from config import apply_args, dataclass_fields, split_args

    @dataclass
    class Tool:
        runs: str = ""
        n: int = 1
        plot: bool = False
        out: str = ""

    fields = dataclass_fields(Tool)
    tool = Tool()
    apply_args(tool, ["a", "--n", "5", "--plot", "b", "--out=x"], fields, positional="runs")
    assert tool == Tool(runs="a,b", n=5, plot=True, out="x")
    tool = Tool()
    apply_args(tool, ["--plot", "false", "--n=2"], fields)
    assert tool == Tool(n=2, plot=False)
    with pytest.raises(ConfigError, match="needs a value"):
        apply_args(Tool(), ["--n"], fields)
    with pytest.raises(ConfigError, match="did you mean 'plot'"):
        apply_args(Tool(), ["--plott"], fields)
    # a tool that also takes train.py's settings: its own options out, the rest (files, overrides) for load_config
    own, rest = split_args(["configs/quickstart.py", "--n", "3", "--swa_window=8", "--plot", "--out", "o"], fields)
    assert own == ["--n", "3", "--plot", "--out", "o"] and rest == ["configs/quickstart.py", "--swa_window=8"]
    cfg = load_config(["configs/quickstart.py", "--attn_pattern", "swa", "--swa_window", "8", "--compile"])  # as train.py
    assert cfg.model.swa_window == 8 and cfg.train.compile is True
    # never silently misread: another option is not a value, and a listed name cannot hold the list's comma
    with pytest.raises(ConfigError, match="'--out' needs a value"):
        apply_args(Tool(), ["--out", "--plot"], fields)
    with pytest.raises(ConfigError, match="with a comma"):
        apply_args(Tool(), ["out/lr=1e-3,bs=8"], fields, positional="runs")
    assert split_args(["--out", "--plot"], fields) == (["--out", "--plot"], [])  # apply_args then refuses it
    # the config files among train.py-style arguments: not the value of a --key value
    from config import config_files

    assert config_files(["--attn_pattern", "swa", "configs/quickstart.py", "--compile", "--seq_len=4"]) == \
        ["configs/quickstart.py"]


@pytest.mark.parametrize("settings, message", [
    ({"attn_pattern": "swa", "swa_window": 1000}, "swa_window=1000 exceeds block_size=256"),
    ({"attn_pattern": "sa", "swa_window": 300}, "swa_window=300 exceeds block_size=256"),
    ({"attn_pattern": "swat", "swa_window": 257}, "swa_window=257 exceeds block_size=256"),
    ({"attn_pattern": "block", "block_len": 512}, "block_len=512 exceeds block_size=256"),
    ({"attn_pattern": "pbb", "block_len": 512, "bridge_width": 64}, "block_len=512 exceeds block_size=256"),
    ({"attn_pattern": "moba", "moba_block": 300}, "moba_block=300 exceeds block_size=256"),
    ({"attn_pattern": "swa,,swa,full"}, "has an empty entry"),
])
def test_settings_that_would_silently_train_full_attention_are_refused(settings, message):
    from config import ConfigError, Config, validate

    cfg = Config()
    cfg.model.block_size, cfg.model.n_layer = 256, 4
    for key, value in settings.items():
        setattr(cfg.model, key, value)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)
    cfg.model.attn_pattern = settings["attn_pattern"].replace(",,", ",swa,")
    cfg.model.swa_window = cfg.model.block_len = cfg.model.moba_block = 256  # the training length itself: allowed
    cfg.model.bridge_width = 64  # (paper 001's vanilla models train so and evaluate with the window)
    validate(cfg)
