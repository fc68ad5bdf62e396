"""No number from data of another tokenizer: evaluation, resume, sampling, the lm-eval adapter and compare refuse
a checkpoint's data, tokenizer file or pretrained weights that do not fit, and an unknown tokenizer fails at once."""

import json
import shutil

import pytest

from conftest import TINY, read_metrics, run_in_process as run, train_in_process
from scripts.gpucheck import tiny_hf
from data.prepare import prepare


@pytest.mark.e2e
def test_eval_on_another_tokenizers_data_refuses_and_writes_nothing(byte_run, bpe):
    before = (byte_run / "eval").exists()
    proc = run(["-m", "eval"], f"--out_dir={byte_run}", f"--data_dir={bpe / 'data_a'}", "--limit=2", "--progress=False")
    assert proc.returncode != 0
    assert "was prepared with the tokenizer" in proc.stderr and "'byte'" in proc.stderr
    assert "--tokenizer=byte" in proc.stderr and "Traceback" not in proc.stderr
    assert (byte_run / "eval").exists() == before and not (byte_run / "eval" / "ppl.json").exists()


@pytest.mark.e2e
def test_resume_on_another_tokenizers_data_refuses(byte_run, bpe, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(byte_run, run_dir)
    checkpoint = (run_dir / "ckpt_last.pt").read_bytes()
    proc = train_in_process([*TINY, f"--out_dir={run_dir}", "--max_iters=12", "--eval_interval=4",
                             "--init_from=resume", f"--data_dir={bpe / 'data_a'}", "--vocab_size=320"], check=False)
    assert proc.returncode == 2 and "cannot resume:" in proc.stderr and "tokenizer" in proc.stderr, proc.stderr
    assert (run_dir / "ckpt_last.pt").read_bytes() == checkpoint  # nothing relabelled
    assert max(read_metrics(run_dir)) == 8


@pytest.mark.e2e
def test_a_run_keeps_its_tokenizer_and_refuses_another_vocabulary_under_its_name(bpe, tmp_path):
    tokenizer = tmp_path / "tok" / "tokenizer.json"
    tokenizer.parent.mkdir()
    shutil.copy(bpe / "a" / "tokenizer.json", tokenizer)
    data = tmp_path / "data"
    prepare(str(bpe / "corpus.txt"), tokenizer=str(tokenizer), out_dir=str(data), val_fraction=0.2, num_proc=1,
            quiet=True)
    out = tmp_path / "run"
    train_in_process([*TINY, f"--out_dir={out}", "--max_iters=2", "--eval_interval=2", f"--data_dir={data}"])
    assert (out / "tokenizer.json").exists()  # the run's own copy
    assert run(["sample.py"], f"--out_dir={out}", "--max_new_tokens=4", "--num_samples=1").returncode == 0
    tokenizer.unlink()  # the file it was trained with is gone: the run needs nothing outside its folder
    assert run(["sample.py"], f"--out_dir={out}", "--max_new_tokens=4", "--num_samples=1").returncode == 0
    assert run(["export.py"], f"--out_dir={out}", f"--to={tmp_path / 'hf'}").returncode == 0
    shutil.copy(bpe / "b" / "tokenizer.json", out / "tokenizer.json")  # the run's copy replaced: another vocabulary
    proc = run(["sample.py"], f"--out_dir={out}", "--max_new_tokens=4", "--num_samples=1")
    assert proc.returncode == 1 and "has another vocabulary than the one" in proc.stderr, proc.stderr
    from runtime.checkpoint import CheckpointError
    from eval.lm_eval_adapter import EfficientAttentionLM

    with pytest.raises(CheckpointError, match="another vocabulary"):
        EfficientAttentionLM(pretrained=str(out), device="cpu")
    (out / "tokenizer.json").unlink()  # neither the copy nor the file: the fix is that file, not another tokenizer
    proc = run(["sample.py"], f"--out_dir={out}", "--max_new_tokens=4", "--num_samples=1")
    assert proc.returncode == 1 and "cannot be loaded" in proc.stderr and str(tokenizer) in proc.stderr
    assert "--tokenizer" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_file_that_is_no_tokenizer_is_named_as_such(tmp_path):
    from data.tokenizer import TokenizerUnavailable, get_tokenizer

    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "vocab": {"a": 0}}')  # JSON, not a tokenizer
    with pytest.raises(TokenizerUnavailable, match="is not a Hugging Face tokenizer file") as info:
        get_tokenizer(str(tmp_path / "tokenizer.json"))
    assert "network" not in str(info.value) and "gated" not in str(info.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerUnavailable, match="folder without a tokenizer.json"):
        get_tokenizer(str(tmp_path / "empty"))


@pytest.mark.e2e
def test_compare_refuses_an_evaluation_of_another_tokenizers_data(byte_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(byte_run, run_dir)
    proc = run(["-m", "eval"], f"--out_dir={run_dir}", "--limit=2", "--progress=False")
    assert proc.returncode == 0, proc.stderr
    assert run(["-m", "scripts.compare", str(run_dir)]).returncode == 0
    report = json.loads((run_dir / "eval" / "ppl.json").read_text())
    assert report["provenance"]["data_tokenizer"]["tokenizer"] == "byte"
    report["provenance"]["data_tokenizer"] = {"tokenizer": "gpt2", "vocab_size": 50257, "eot_id": 50256}
    (run_dir / "eval" / "ppl.json").write_text(json.dumps(report))
    proc = run(["-m", "scripts.compare", str(run_dir)])
    assert proc.returncode == 2 and "'gpt2'" in proc.stderr and "re-run python -m eval" in proc.stderr, proc.stderr


@pytest.mark.e2e
def test_a_tokenizer_file_that_changed_under_its_data_is_refused(bpe, tmp_path):
    # the data was prepared with a/tokenizer.json; that path now holds another vocabulary of the same size
    shutil.copytree(bpe / "a", tmp_path / "a")
    shutil.copytree(bpe / "data_a", tmp_path / "data_a")
    meta = json.loads((tmp_path / "data_a" / "meta.json").read_text())
    meta["tokenizer"] = str(tmp_path / "a" / "tokenizer.json")
    (tmp_path / "data_a" / "meta.json").write_text(json.dumps(meta))
    shutil.copy(bpe / "b" / "tokenizer.json", tmp_path / "a" / "tokenizer.json")
    proc = train_in_process([*TINY, f"--data_dir={tmp_path / 'data_a'}", f"--out_dir={tmp_path / 'run'}",
                             "--max_iters=1"], check=False)
    assert proc.returncode != 0 and "another vocabulary of that size" in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_pretrained_weights_refuse_data_of_another_tokenizer(tmp_path):
    folder, _ = tiny_hf.build_tiny_hf_model(tmp_path / "hf")
    proc = train_in_process(["configs/quickstart.py", f"--init_from=hf:{folder}", "--data_dir=data/embedded_byte",
                             f"--out_dir={tmp_path / 'run'}", "--max_iters=1"], check=False)
    assert proc.returncode == 2 and "was prepared with the tokenizer 'byte'" in proc.stderr, proc.stderr
    assert f"init_from=hf:{folder}" in proc.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.e2e
def test_an_unknown_tokenizer_fails_at_once_offline(tmp_path):
    import time

    started = time.time()
    proc = run(["-m", "data.prepare"], "--dataset=README.md", "--tokenizer=nobody/no-such-tokenizer",
               f"--out_dir={tmp_path / 'data'}")
    assert proc.returncode != 0 and "no-such-tokenizer" in proc.stderr and "Traceback" not in proc.stderr
    assert time.time() - started < 15  # not the hub client's retries (about 20 s)


def test_the_hub_probe_leaves_proxied_connections_to_the_hub_client(monkeypatch):
    import socket

    from data import tokenizer

    def refused(*args, **kwargs):
        raise OSError(111, "Connection refused")

    monkeypatch.setattr(socket, "create_connection", refused)
    for name in ("HF_HUB_OFFLINE", "HF_ENDPOINT", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY", "no_proxy",
                 "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    assert tokenizer._hub_unreachable() == "huggingface.co: Connection refused"  # no proxy: said at once
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert tokenizer._hub_unreachable() == ""  # only the proxy can say: the hub client goes through it
    monkeypatch.setenv("NO_PROXY", "huggingface.co")
    assert tokenizer._hub_unreachable() == "huggingface.co: Connection refused"
