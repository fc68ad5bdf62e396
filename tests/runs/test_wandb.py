"""wandb: a run's group, tags and config, tokens_seen as the x-axis, resuming, and python -m eval's results in the
training run's summary. Runs log offline into their run folder; the tests read wandb's own files back (the
run-ID.wandb log of wandb_internal_pb2.Record protobufs that `wandb sync` uploads)."""

import json
import shutil
import struct
import time

import pytest
from wandb.proto import wandb_internal_pb2

from runtime import wandb_run
from config import ConfigError, load_config
from eval.summaries import evaluation_summary
from conftest import run_in_process

TOKENS_PER_STEP = 4 * 2 * 32  # batch_size x gradient_accumulation_steps x block_size
TINY = ["configs/quickstart.py", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4",
        "--gradient_accumulation_steps=2", "--eval_iters=2", "--log_interval=1", "--eval_interval=2",
        "--warmup_iters=1", "--wandb_log=True", "--wandb_mode=offline"]


_last_command = {"ended": 0.0}


def in_process(command, *args):
    """python COMMAND ARGS in this process (conftest.run_in_process), ended as a process's exit ends wandb: its
    service writes out the run's files and forgets the settings it read (as a fresh process starts without them).
    wandb names a run's offline folder by the second it was opened in, and a command here can start and end within
    one second: the next one waits for a new second, so each (a resume, an evaluation) keeps a folder of its own."""
    import wandb

    while int(time.time()) <= int(_last_command["ended"]):
        time.sleep(0.02)
    try:
        return run_in_process(command, *args)
    finally:
        wandb.teardown()
        _last_command["ended"] = time.time()


def train(*args):
    proc = in_process(["train.py"], *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(autouse=True)
def wandb_files_in_tmp(tmp_path, monkeypatch):
    """wandb's own settings and caches under the test's folder (the runs write into their run folders)."""
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home" / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")


def wandb_log(path) -> list:
    """The records of a run-ID.wandb file. Its format is LevelDB's log: a 7-byte header (":W&B", 0xBEE1, version),
    then 32 KiB blocks of chunks, each with a 7-byte header (CRC32C, length, type: 1 full, 2 first, 3 middle,
    4 last); a record is one full chunk or first + middles + last, and a block's tail too short for a header
    is padding."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb log"
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # the zeros after the last record
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _items(items) -> dict:
    return {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in items}


def segments(run_dir, run_id) -> list[dict]:
    """Each process's part of the wandb run (one offline folder per process that opened it), oldest first: its run
    record, config, history rows, summary and metric definitions."""
    folders = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    out = []
    for folder in folders:
        parts = {"folder": folder, "run": None, "history": [], "summary": {}, "metrics": []}
        for record in wandb_log(folder / f"run-{run_id}.wandb"):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                parts["run"] = record.run
                parts["config"] = {item.key: json.loads(item.value_json) for item in record.run.config.update
                                   if item.key != "_wandb"}
            elif kind == "history":
                parts["history"].append(_items(record.history.item))
            elif kind == "summary":
                parts["summary"].update(_items(record.summary.update))
            elif kind == "metric":
                parts["metrics"].append(record.metric)
        out.append(parts)
    return out


@pytest.fixture(scope="module")
def swa_run(tmp_path_factory):
    """3 steps of a 2-layer swa model logging to wandb offline (validation at steps 0, 2 and 3), with a tag added to
    those it is given."""
    out = tmp_path_factory.mktemp("swa")
    train(*TINY, f"--out_dir={out}", "--attn_pattern=swa", "--swa_window=16", "--max_iters=3",
          "--wandb_tags=+ablation")
    return out


@pytest.mark.e2e
def test_a_run_is_grouped_tagged_and_plotted_against_the_tokens_it_has_seen(swa_run):
    record = json.loads((swa_run / "wandb.json").read_text())
    [run] = segments(swa_run, record["id"])
    assert run["run"].run_id == record["id"] and record["mode"] == "offline"
    # the data and size group the run with its variants and seeds; the registry's variant and papers tag it
    assert run["run"].run_group == record["group"] == "embedded_byte-2x32"
    assert list(run["run"].tags) == record["tags"] == ["swa", "paper-001", "paper-002", "paper-003", "ablation"]
    assert any(m.glob_name == "*" and m.step_metric == "tokens_seen" for m in run["metrics"])
    rows = run["history"]
    assert rows and all(row["tokens_seen"] == row["_step"] * TOKENS_PER_STEP for row in rows)
    assert sorted(row["_step"] for row in rows if "train_loss" in row) == [1, 2, 3]
    assert sorted(row["_step"] for row in rows if "val_loss" in row) == [0, 2, 3]
    logged = [json.loads(line) for line in (swa_run / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"]: r["train_loss"] for r in logged if "train_loss" in r} == \
        {row["_step"]: row["train_loss"] for row in rows if "train_loss" in row}
    assert run["summary"]["tokens_seen"] == 3 * TOKENS_PER_STEP
    # the config: only the settings the layers read, as config.json holds them
    model = run["config"]["model"]
    assert model["attn_pattern"] == "swa" and model["swa_window"] == 16
    assert not {"moba_block", "block_len", "bridge_width", "mlstm_n_head", "swat_slopes"} & set(model)
    assert run["config"]["train"]["batch_size"] == 4 and run["config"]["n_params"] > 0
    assert model == json.loads((swa_run / "config.json").read_text())["model"]


@pytest.mark.e2e
def test_a_resumed_run_continues_its_wandb_run_its_tags_and_its_token_count(swa_run, tmp_path):
    run = shutil.copytree(swa_run, tmp_path / "run")
    run_id = json.loads((run / "wandb.json").read_text())["id"]
    # resumed without the tag, in another group, and with half the tokens per step from here on
    proc = train(*TINY, f"--out_dir={run}", "--attn_pattern=swa", "--swa_window=16", "--max_iters=5",
                 "--init_from=resume", "--gradient_accumulation_steps=1", "--wandb_group=sweep_a")
    assert f"wandb: run {run_id} (offline) in group 'sweep_a'" in proc.stdout
    first, second = segments(run, run_id)
    assert second["run"].run_group == "sweep_a" and list(second["run"].tags) == list(first["run"].tags)
    assert "ablation" in second["run"].tags  # kept from the run's start (wandb.json), not derived afresh
    assert json.loads((run / "wandb.json").read_text())["group"] == "sweep_a"
    assert {row["_step"]: row["tokens_seen"] for row in second["history"] if "train_loss" in row} == \
        {4: 3 * TOKENS_PER_STEP + TOKENS_PER_STEP // 2, 5: 3 * TOKENS_PER_STEP + 2 * (TOKENS_PER_STEP // 2)}


def test_groups_and_tags_come_from_the_recipe_and_the_registry():
    cfg = load_config(["configs/bridges/bridges_cpu_pbb.py"])
    group = wandb_run.default_group(cfg, ["configs/bridges/bridges_cpu_pbb.py", "--seed=2"])
    assert group == f"bridges-{cfg.data.dataset}-{cfg.model.n_layer}x{cfg.model.n_embd}"
    assert wandb_run.default_group(cfg, ["out/run/config.json"]).startswith(cfg.data.dataset)
    assert wandb_run.default_tags(cfg.model.attn_pattern)[-1] == "paper-004"
    assert wandb_run.default_tags("swax") == ["swax", "swa", "mlstm", "paper-003"]  # the papers all its layers share
    assert wandb_run.pattern_papers("swa,swa,swa,full") == ["001", "002", "003"]
    assert wandb_run.pattern_papers("moba") == ["000"] and wandb_run.pattern_papers("full") == []


@pytest.mark.parametrize("setting, message", [
    ("--wandb_tags=a,,b", "empty tag"), ("--wandb_tags=+", "adds no tag"),
    (f"--wandb_tags={'x' * 65}", "at most 64"), (f"--wandb_group={'g' * 129}", "at most 128"),
    ("--wandb_group= padded", "no spaces at its ends")])
def test_bad_groups_and_tags_are_refused_with_the_fix(setting, message):
    with pytest.raises(ConfigError, match=message):
        load_config(["configs/quickstart.py", setting])


def run_eval(run, *args):
    proc = in_process(["-m", "eval"], f"--out_dir={run}", "--progress=False", "--tasks=ppl", "--ppl_lengths=32",
                      "--ppl_max_tokens=2000", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def ppl_of(run, data_name) -> float:
    report = json.loads((run / "eval" / "ppl.json").read_text())
    sid = next(sid for sid, s in report["settings"].items() if s["data"]["name"] == data_name)
    return next(row["ppl"] for row in report["results"]["rows"] if row["setting"] == sid)


@pytest.mark.e2e
def test_evaluation_results_go_into_the_training_runs_summary(swa_run, tmp_path):
    run = shutil.copytree(swa_run, tmp_path / "run")
    run_id = json.loads((run / "wandb.json").read_text())["id"]
    proc = run_eval(run)
    assert f"written to the summary of run {run_id}" in proc.stdout
    training, evaluation = segments(run, run_id)
    assert evaluation["run"].run_id == run_id and evaluation["run"].run_group == training["run"].run_group
    own = ppl_of(run, "embedded_byte")
    assert evaluation["summary"]["eval/ppl/ppl@L=32"] == own
    assert evaluation["history"] == []  # numbers for the summary, not rows on the training curves

    # text other than the run's own validation split: labelled in the key, the run's own number left as it was
    essay = tmp_path / "essay.txt"
    essay.write_text("\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." * 3 for i in range(60)))
    prepared = run_in_process(["-m", "data.prepare"], f"--dataset={essay}", f"--out_dir={tmp_path / 'essay'}",
                              "--val_fraction=0.2")
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    run_eval(run, f"--data_dir={tmp_path / 'essay'}")
    *_, other = segments(run, run_id)
    assert other["summary"]["eval/ppl/ppl@L=32 (data essay)"] == ppl_of(run, "essay") != own
    assert other["summary"]["eval/ppl/ppl@L=32"] == own

    run_eval(run, "--wandb=False")
    assert len(segments(run, run_id)) == 3

    # scripts/compare.py reads the run back from wandb: its config, curves and these results
    from eval.records import wandb_record
    from eval.tables import build_tables

    parts = segments(run, run_id)

    class Run:
        name, path, config = "run", ["entity", "project", run_id], parts[0]["config"]
        summary = {k: v for part in parts for k, v in part["summary"].items()}

        def history(self, keys, samples, pandas):
            return [row for part in parts for row in part["history"] if keys[0] in row]

    record = wandb_record(Run())
    assert record["config"]["model"]["attn_pattern"] == "swa" and record["extra"]["eval/ppl/ppl@L=32"] == own
    assert [step for step, _ in record["train"]] == [1, 2, 3]
    row = build_tables([record])["rows"][0]
    assert row["cells"]["tokens"] == 3 * TOKENS_PER_STEP and row["flat"]["swa_window"] == 16


@pytest.mark.e2e
def test_an_unreachable_or_missing_wandb_is_a_note_and_the_results_stay_local(swa_run, tmp_path, capsys,
                                                                               monkeypatch):
    run = shutil.copytree(swa_run, tmp_path / "run")
    record = json.loads((run / "wandb.json").read_text())
    (run / "wandb.json").write_text(json.dumps({**record, "mode": "online"}))
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no login
    proc = run_eval(run)
    assert "wandb is not reachable (no wandb login" in proc.stderr and "offline copy" in proc.stderr
    assert f"results of ppl written to the summary of run {record['id']} (offline" in proc.stdout
    assert segments(run, record["id"])[-1]["summary"]["eval/ppl/ppl@L=32"] == ppl_of(run, "embedded_byte")

    monkeypatch.setattr(wandb_run, "package_problem", lambda: "the wandb package is not installed")
    wandb_run.report_evaluation(run, evaluation_summary(run, ["ppl"]))
    assert "not installed: its results are in" in capsys.readouterr().err
    assert len(segments(run, record["id"])) == 2

    plain = tmp_path / "plain"  # a run that did not log to wandb: nothing to say
    plain.mkdir()
    wandb_run.report_evaluation(plain, evaluation_summary(plain, ["ppl"]))
    assert capsys.readouterr() == ("", "") and not (plain / "wandb").exists()
