"""A run holds only its own settings: config.json, the checkpoints and the wandb config carry the model's fields and
the settings of the mixers in its pattern; a mixer setting given where no mixer of the pattern reads it is refused
in one line; runs saved with every variant's settings (before runs kept only their own) load, sample and resume; a
pattern alias declared by a variant module reaches every list the registry gives."""

import dataclasses
import json
import re
import shutil

import pytest
import torch

import train
from attention import registry
from attention.registry import SETTINGS, example_cases, layer_names, pattern_names, register_pattern, setting_name
from config import Config, ConfigError, load_config
from conftest import REPO, TINY, load_script, run_in_process, train_in_process
from runtime.checkpoint import load_checkpoint, load_model
from runtime.wandb_run import run_config

SWA = [*TINY, "--attn_pattern=swa", "--swa_window=16", "--eval_interval=1", "--device=cpu"]


def own_settings(*mixers) -> set[str]:
    """The declared settings the mixers read."""
    return {setting_name(s) for name in mixers for s in registry.MIXERS[name].settings} & set(SETTINGS)


@pytest.fixture(scope="module")
def swa_run(tmp_path_factory):
    """One step of a 2-layer swa model, trained in this process (conftest.run_in_process: the signal handlers,
    the run folder's lock and the environment the run sets are put back; it starts git for the run's record)."""
    out = tmp_path_factory.mktemp("swa")
    train_in_process([*SWA, f"--out_dir={out}", "--max_iters=1"])
    return out


@pytest.mark.e2e
def test_a_swa_runs_config_json_holds_no_setting_of_another_mixer(swa_run):
    model = json.loads((swa_run / "config.json").read_text())["model"]
    assert model["attn_pattern"] == "swa" and model["swa_window"] == 16
    assert set(model) & set(SETTINGS) == own_settings("swa") == {"swa_window"}
    every_field = {f.name for f in dataclasses.fields(Config().model)}
    assert set(model) == every_field - (set(SETTINGS) - {"swa_window"})  # every core field of the model
    # the checkpoints and the wandb config hold the same
    for name in ("ckpt_best.pt", "ckpt_last.pt"):
        assert load_checkpoint(swa_run / name)["config"]["model"] == model
    assert run_config(Config.from_dict(json.loads((swa_run / "config.json").read_text())))["model"] == model


def test_a_hybrids_saved_config_holds_the_settings_of_both_its_mixers():
    cfg = load_config(["--attn_pattern=swax", "--n_layer=2", "--swa_window=64", "--mlstm_n_head=2"])
    saved = cfg.to_dict()["model"]
    assert set(saved) & set(SETTINGS) == own_settings("swa", "mlstm")
    assert saved["swa_window"] == 64 and saved["mlstm_n_head"] == 2
    again = Config.from_dict(cfg.to_dict())  # the settings it lacks take their defaults
    assert again.model == cfg.model and again.to_dict() == cfg.to_dict()


def refusal(capsys, argv) -> str:
    """train.py's exit status 2 and its one line, for a config that is refused."""
    with pytest.raises(SystemExit) as exit_:
        train.main(argv)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_setting_no_mixer_of_the_pattern_reads_is_refused_in_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    line = refusal(capsys, [*SWA, f"--out_dir={out}", "--moba_block=64"])
    assert line == ("config error: --moba_block=64 is a setting of moba, and attn_pattern='swa' has no such layer: "
                    "drop --moba_block, or put moba in attn_pattern")
    assert not out.exists()  # refused before anything is written
    recipe = tmp_path / "recipe.py"
    recipe.write_text('attn_pattern = "swa"\nswa_window = 16\nmoba_block = 64\n')
    line = refusal(capsys, [str(recipe), *TINY[1:], f"--out_dir={out}"])
    assert line == (f"config error: moba_block=64 in {recipe} is a setting of moba, and attn_pattern='swa' has no such "
                    f"layer: drop it from {recipe}, or put moba in attn_pattern")
    # a pattern given after a config file that set a setting of the pattern it replaces
    recipe.write_text('attn_pattern = "swa"\nswa_window = 16\n')
    line = refusal(capsys, [str(recipe), *TINY[1:], f"--out_dir={out}", "--attn_pattern=block"])
    assert line.startswith(f"config error: swa_window=16 in {recipe} is a setting of swa, ") and \
        line.endswith(f"and attn_pattern='block' has none of them: drop it from {recipe}, or put one of them in "
                      "attn_pattern")
    assert not out.exists()


def test_the_refusal_names_an_aliases_mixers_and_every_setting_it_refuses():
    with pytest.raises(ConfigError) as refused:
        load_config(["--attn_pattern=swax", "--n_layer=2", "--block_len=64", "--moba_topk=3"])
    assert str(refused.value) == ("--block_len=64 is a setting of block, bridge, pbb and se_bridge, and "
                                  "attn_pattern='swax' (swa,mlstm) has none of them: drop --block_len, or put one of "
                                  "them in attn_pattern (moba_topk likewise)")


def test_what_is_not_refused(tmp_path):
    # a setting several mixers read counts for any of them
    assert load_config(["--attn_pattern=sa", "--swa_window=64"]).model.swa_window == 64
    # a base a recipe includes may set the settings of its family's other variants (the bridges' geometry)
    cfg = load_config(["configs/bridges/bridges_cpu_swa.py"])
    assert cfg.model.block_len == 64 and "block_len" not in cfg.to_dict()["model"]
    recipe = tmp_path / "recipe.py"
    recipe.write_text('include("configs/bridges/bridges_cpu_base.py")\nattn_pattern = "pbb"\n')
    assert load_config([str(recipe), "--attn_pattern=swa"]).model.attn_pattern == "swa"
    # a run's saved config.json, even one holding every variant's settings
    saved = tmp_path / "config.json"
    old = dataclasses.asdict(load_config(["--attn_pattern=swa", "--swa_window=16"]))
    old["model"]["moba_block"] = 64
    saved.write_text(json.dumps(old))
    assert load_config([str(saved)]).model.moba_block == 64


def old_format(run, moba_block=64):
    """The run as runs were saved before they kept only their own settings: every variant's setting in config.json
    and the checkpoints, here moba_block with a value a recipe might have set though no layer read it."""
    def widen(config: dict) -> dict:
        full = dataclasses.asdict(Config.from_dict(config))
        full["model"]["moba_block"] = moba_block
        return {**config, **full}

    saved = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps(widen(saved)))
    for name in ("ckpt_best.pt", "ckpt_last.pt"):
        ckpt = torch.load(run / name, weights_only=True)
        ckpt["config"] = widen(ckpt["config"])
        torch.save(ckpt, run / name)


@pytest.mark.e2e
def test_a_run_saved_with_every_variants_settings_loads_samples_and_resumes(swa_run, tmp_path):
    run = shutil.copytree(swa_run, tmp_path / "old", ignore=shutil.ignore_patterns(".lock"))
    old_format(run)
    assert "moba_block" in load_checkpoint(run / "ckpt_last.pt")["config"]["model"]
    model, cfg, _ = load_model(run, "last")
    assert cfg.model.attn_pattern == "swa" and cfg.model.swa_window == 16 and "moba_block" not in cfg.to_dict()["model"]
    sampled = run_in_process(["sample.py"], f"--out_dir={run}", "--num_samples=1", "--max_new_tokens=4", "--device=cpu")
    assert sampled.returncode == 0 and sampled.stdout.count("---------------") == 1, sampled.stderr
    # resumed with the command line's settings (moba_block at its default, not the checkpoint's 64: no layer reads
    # it, so the model is the same) and then saved in the new form
    train_in_process([*SWA, f"--out_dir={run}", "--max_iters=2", "--init_from=resume"])
    assert load_checkpoint(run / "ckpt_last.pt")["step"] == 2
    for saved in (json.loads((run / "config.json").read_text()), load_checkpoint(run / "ckpt_last.pt")["config"]):
        assert "moba_block" not in saved["model"] and saved["model"]["swa_window"] == 16


def test_a_pattern_alias_declared_at_run_time_is_in_every_list(monkeypatch):
    # the registry's dict, copied: the alias is gone again after the test
    monkeypatch.setattr(registry, "PATTERN_ALIASES", dict(registry.PATTERN_ALIASES))
    register_pattern("swa_moba", "swa, moba", paper="000", summary="a window beside MoBA's chosen blocks")
    assert pattern_names("swa_moba,full") == ["swa", "moba", "full"]
    case = example_cases(32)["swa_moba"]
    assert case["attn_pattern"] == "swa_moba" and {"swa_window", "moba_block"} <= set(case)
    table = load_script("variants").variants_table()
    assert ("| `swa_moba` | 000 | the pattern `swa,moba`: a window beside MoBA's chosen blocks | those of `swa`, "
            "`moba` |") in table
    cfg = load_config(["--attn_pattern=swa_moba", "--n_layer=4", "--moba_block=64"])
    assert layer_names(cfg.model) == ["swa", "moba"] * 2
    assert set(cfg.to_dict()["model"]) & set(SETTINGS) == own_settings("swa", "moba")
    with pytest.raises(ValueError, match="declared twice"):
        register_pattern("swa_moba", "swa")
    with pytest.raises(ValueError, match="names a mixer"):
        register_pattern("swa", "full")
    with pytest.raises(ValueError, match="names another alias"):
        register_pattern("nested", "swax,full")


def test_every_recipe_in_configs_loads_and_only_a_base_may_be_refused_by_itself():
    """A base that its family's recipes include (bridges_cpu_base.py: attn_pattern=full with the bridges' block and
    window sizes) sets settings its own pattern does not read: run by itself it is refused; every other file loads."""
    files = sorted((REPO / "configs").rglob("*.py"))
    included = {name for path in files for name in re.findall(r'include\("(configs/[\w/.]+)"\)', path.read_text())}
    refused = []
    for path in files:
        name = str(path.relative_to(REPO))
        try:
            load_config([str(path)])
        except ConfigError as e:
            assert name in included and " is a setting of " in str(e), (name, str(e))
            refused.append(name)
    assert "configs/quickstart.py" not in refused and len(refused) < len(included)
