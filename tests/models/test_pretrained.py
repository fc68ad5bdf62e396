"""init_from=gpt2 / hf:PATH: GPT-2, Llama, Mistral, Qwen2 and Qwen3 checkpoints of transformers load into this
model exactly (checked on small random ones written by save_pretrained, shaped like the real things), train
under any attention pattern, and what cannot load is refused with a message."""

import json

import pytest
import torch
import transformers

from config import ModelConfig
from conftest import REPO, train_in_process
from model import GPT
from runtime.pretrained import PretrainedError, load_hf_model, load_pretrained_weights, pretrained_model_config

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
    with pytest.raises(PretrainedError, match="has mlstm layers, which have no counterpart"):
        load(gpt2_dir, attn_pattern="mlstm")
    with pytest.raises(PretrainedError, match="block_size=128 is longer"):
        load(gpt2_dir, block_size=128)


LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=320, max_position_embeddings=128)
LLAMA_FAMILY = {  # grouped-query attention in all; Qwen2's qkv biases, Qwen3's head width and qk-norm, tied
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {**LLAMA_LIKE, "rope_theta": 5e5}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, LLAMA_LIKE),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              {**LLAMA_LIKE, "head_dim": 32, "tie_word_embeddings": True}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {**LLAMA_LIKE, "sliding_window": 16}),
}


def save_llama_like(name, path, **overrides):
    config_class, model_class, settings = LLAMA_FAMILY[name]
    torch.manual_seed(0)
    model = model_class(config_class(**{**settings, **overrides}))
    with torch.no_grad():  # non-trivial norms and biases, so a misplaced one shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("name", LLAMA_FAMILY)
def test_llama_family_checkpoints_equal_transformers(name, tmp_path):
    path = save_llama_like(name, tmp_path / name)
    hf = load_hf_model(str(path))
    # Mistral's own sliding window of 16: the note's swa setting reproduces the model
    m = ModelConfig(block_size=64, **({"attn_pattern": "swa", "swa_window": 16} if name == "mistral" else {}))
    changed = pretrained_model_config(hf.config, m)
    model = GPT(m)
    assert load_pretrained_weights(model, hf) == []
    assert (m.arch, m.n_kv_head, m.qk_norm, m.qkv_bias) == ("llama", 2, name == "qwen3", name == "qwen2")
    assert m.attn_head_dim == (32 if name == "qwen3" else 0) and m.tie_embeddings == (name == "qwen3")
    assert (name == "mistral") == any("sliding window of 16" in line for line in changed)
    idx = torch.randint(0, 320, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(idx)[0], hf(idx).logits, atol=1e-5, rtol=0)


def test_what_the_llama_arch_cannot_express_is_refused(tmp_path):
    path = save_llama_like("llama", tmp_path / "scaled", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                         "rope_theta": 1e4})
    with pytest.raises(PretrainedError, match="scales RoPE"):
        pretrained_model_config(load_hf_model(str(path)).config, ModelConfig(block_size=64))
    path = save_llama_like("llama", tmp_path / "biased", attention_bias=True)
    with pytest.raises(PretrainedError, match="biases on the MLP or the attention output"):
        pretrained_model_config(load_hf_model(str(path)).config, ModelConfig(block_size=64))
    config = transformers.GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, vocab_size=64)
    transformers.GPTNeoXForCausalLM(config).save_pretrained(tmp_path / "neox")
    with pytest.raises(PretrainedError, match="is a gpt_neox model"):
        load_hf_model(str(tmp_path / "neox"))
    with pytest.raises(PretrainedError, match="cannot read the checkpoint"):
        load_hf_model(str(tmp_path / "missing"))
    hf = load_hf_model(str(save_llama_like("qwen3", tmp_path / "qwen3")))
    # a recurrent pattern is refused before the checkpoint's shapes are set (they are not the user's settings)
    with pytest.raises(PretrainedError, match="gated_deltanet layers, which have no counterpart"):
        pretrained_model_config(hf.config, ModelConfig(block_size=64, attn_pattern="gated_deltanet"))
    from attention import validate_config

    with pytest.raises(ValueError, match="only attention mixers take these"):  # shapes set by hand
        validate_config(ModelConfig(block_size=64, attn_pattern="gated_deltanet", n_kv_head=2, n_head=4))


@pytest.mark.e2e
def test_training_continues_from_a_qwen3_checkpoint_with_its_own_tokenizer(tmp_path):
    """The checkpoint's tokenizer.json tokenizes the data (prepare.py --tokenizer=FOLDER); step 0's validation
    loss is the transformers model's on the same batches; training continues under another pattern."""
    from data.embedded import documents
    from data.loader import WindowSampler
    from data.prepare import prepare
    from scripts.gpucheck.tiny_hf import train_byte_bpe_tokenizer as build_tokenizer

    text = "\n\n".join(documents(60, seed=0))
    folder = tmp_path / "qwen3"
    folder.mkdir()
    vocab = build_tokenizer(text, folder / "tokenizer.json")
    save_llama_like("qwen3", folder, vocab_size=vocab)
    (tmp_path / "corpus.txt").write_text(text)
    data_dir = tmp_path / "data"
    prepare(str(tmp_path / "corpus.txt"), tokenizer=str(folder), out_dir=str(data_dir), val_fraction=0.2,
            num_proc=1, quiet=True)
    args = ["configs/quickstart.py", f"--init_from=hf:{folder}", f"--data_dir={data_dir}", "--block_size=32",
            "--batch_size=4", "--eval_iters=2", "--dropout=0.0"]
    train_in_process([*args, "--eval_only=True", f"--out_dir={tmp_path / 'eval'}"])
    val_loss = [json.loads(line)["val_loss"] for line in open(tmp_path / "eval" / "metrics.jsonl")][0]
    hf = load_hf_model(str(folder))
    val = WindowSampler(str(data_dir), "val", 32, 4, 2)
    with torch.no_grad():
        expected = sum(torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
                       for x, y in (val.batch(0, i) for i in range(2))) / 2
    assert val_loss == pytest.approx(expected, abs=1e-5)
    proc = train_in_process([*args, "--attn_pattern=sa_swa", "--swa_window=8", "--max_iters=2", "--eval_interval=2",
                             "--warmup_iters=1", "--lr_decay_iters=2", f"--out_dir={tmp_path / 'sa_swa'}"])
    assert "loaded" in proc.stdout and "done" in proc.stdout


@pytest.mark.e2e
def test_training_starts_from_the_pretrained_weights(gpt2_dir, tmp_path):
    from data.loader import WindowSampler

    args = ["configs/quickstart.py", f"--init_from=hf:{gpt2_dir}", "--block_size=32", "--batch_size=4",
            "--eval_iters=2", "--dropout=0.0"]
    proc = train_in_process([*args, "--eval_only=True", f"--out_dir={tmp_path / 'eval'}"])
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
    proc = train_in_process([*args, "--attn_pattern=swa", "--swa_window=8", "--max_iters=3", "--eval_interval=3",
                             "--warmup_iters=1", "--lr_decay_iters=3", f"--out_dir={tmp_path / 'swa'}"])
    assert "loaded" in proc.stdout and "done" in proc.stdout


@pytest.mark.e2e
def test_bad_pretrained_settings_exit_with_status_2(gpt2_dir, tmp_path, offline):
    for extra, message in ((["--attn_pattern=mlstm"], "no counterpart"), (["--block_size=128"], "is longer"),
                           ([], None)):
        init = f"--init_from=hf:{gpt2_dir}" if message else "--init_from=gpt2"  # gpt2: no network here
        proc = train_in_process(["configs/quickstart.py", init, "--block_size=32", *extra,
                                 f"--out_dir={tmp_path / 'run'}"], check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert (message or "cannot read the checkpoint") in proc.stderr
        assert not (tmp_path / "run").exists()
