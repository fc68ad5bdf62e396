"""init_from=gpt2 / hf:PATH: a GPT-2 checkpoint of transformers loads into this model exactly (checked on a small
random one written by save_pretrained, shaped like the real thing), trains under any attention pattern, and
what cannot load is refused with a message."""

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

from config import ModelConfig
from conftest import REPO, train_subprocess
from model import GPT
from pretrained import PretrainedError, load_hf_model, load_pretrained_weights, pretrained_model_config

SMALL = dict(n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=320)  # vocab: the byte corpus fits


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**SMALL))
    with torch.no_grad():  # non-trivial biases and norms, so a misplaced one shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    model.save_pretrained(path)
    return path


def load(path, **config) -> tuple[GPT, list[str]]:
    hf = load_hf_model(str(path))
    m = ModelConfig(**{"block_size": 32, **config})
    pretrained_model_config(hf.config, m)
    model = GPT(m)
    return model, load_pretrained_weights(model, hf)


def test_loaded_model_equals_transformers_gpt2(gpt2_dir):
    model, fresh = load(gpt2_dir, arch="llama", n_layer=7, bias=False)  # the checkpoint's architecture wins
    assert fresh == [] and model.config.arch == "gpt2" and model.config.n_layer == 2
    assert model.config.gelu == "tanh" and model.wpe.weight.shape[0] == 32  # gelu_new; positions cropped
    hf = load_hf_model(str(gpt2_dir))
    idx = torch.randint(0, 320, (2, 32))
    with torch.no_grad():
        ours, _ = model.eval()(idx)
        theirs = hf(idx).logits
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()


def test_attention_weights_load_into_sparse_patterns_and_new_parameters_are_listed(gpt2_dir):
    model, fresh = load(gpt2_dir, attn_pattern="swa", swa_window=8)
    hf = load_hf_model(str(gpt2_dir))
    assert torch.equal(model.blocks[1].mixer.c_attn.weight, hf.transformer.h[1].attn.c_attn.weight.t())
    assert fresh == []
    _, fresh = load(gpt2_dir, attn_pattern="sa_swa", swa_window=8)  # its two path gates are not in GPT-2
    assert fresh and all(".mixer." in name for name in fresh)
    with pytest.raises(PretrainedError, match="has no"):
        load(gpt2_dir, attn_pattern="mlstm")
    with pytest.raises(PretrainedError, match="block_size=128 is longer"):
        load(gpt2_dir, block_size=128)


def test_only_gpt2_checkpoints_load(tmp_path):
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, vocab_size=64)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    with pytest.raises(PretrainedError, match="is a llama model"):
        load_hf_model(str(tmp_path / "llama"))
    with pytest.raises(PretrainedError, match="cannot read the checkpoint"):
        load_hf_model(str(tmp_path / "missing"))


def test_training_starts_from_the_pretrained_weights(gpt2_dir, tmp_path):
    from data.loader import WindowSampler

    args = ["configs/quickstart.py", f"--init_from=hf:{gpt2_dir}", "--block_size=32", "--batch_size=4",
            "--eval_iters=2", "--dropout=0.0"]
    proc = train_subprocess([*args, "--eval_only=True", f"--out_dir={tmp_path / 'eval'}"])
    assert "warning" in proc.stdout and "tokenized with 'byte'" in proc.stdout  # a local path's tokenizer
    saved = json.load(open(tmp_path / "eval" / "config.json"))["model"]
    assert (saved["n_layer"], saved["n_embd"], saved["vocab_size"], saved["gelu"]) == (2, 64, 320, "tanh")
    val_loss = [json.loads(line)["val_loss"] for line in open(tmp_path / "eval" / "metrics.jsonl")][0]
    # the same validation batches through transformers' model
    hf = load_hf_model(str(gpt2_dir))
    val = WindowSampler(str(REPO / "data" / "embedded_byte"), "val", 32, 4, 2)
    with torch.no_grad():
        batches = [val.batch(0, i) for i in range(2)]
        expected = sum(torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
                       for x, y in batches) / 2
    assert val_loss == pytest.approx(expected, abs=1e-5)
    # uptraining the full-attention checkpoint to a sliding window
    proc = train_subprocess([*args, "--attn_pattern=swa", "--swa_window=8", "--max_iters=3", "--eval_interval=3",
                             "--warmup_iters=1", "--lr_decay_iters=3", f"--out_dir={tmp_path / 'swa'}"])
    assert "loaded" in proc.stdout and "done" in proc.stdout


def test_bad_pretrained_settings_exit_with_status_2(gpt2_dir, tmp_path):
    env_offline = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for extra, message in ((["--attn_pattern=mlstm"], "has no"), (["--block_size=128"], "is longer"),
                           ([], None)):
        init = f"--init_from=hf:{gpt2_dir}" if message else "--init_from=gpt2"  # gpt2: no network here
        proc = subprocess.run([sys.executable, "train.py", "configs/quickstart.py", init, "--block_size=32", *extra,
                               f"--out_dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True,
                              timeout=300, env=env_offline)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert (message or "cannot read the checkpoint") in proc.stderr
        assert not (tmp_path / "run").exists()
