"""export.py: a run leaves as a Hugging Face folder. transformers' own classes (and stock lm_eval) are the
reference: the folder's logits equal the run's, greedy generation is token-identical, stock `lm_eval --model hf`
scores it as this project's adapter scores the run, and init_from=hf:FOLDER reads the same model back."""

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

from conftest import REPO
from config import ModelConfig
from data.tokenizer import get_tokenizer
from export import ExportConfig, export_run, main
from helpers import SENTENCES, save_run, write_tasks
from runtime.hf_tokenizer import hf_tokenizer
from model import GPT

BLOCK = 64
SHAPE = dict(n_layer=2, n_head=2, n_embd=32, block_size=BLOCK, vocab_size=320)
CASES = {  # ModelConfig settings -> the class the folder must be
    "gpt2": (dict(arch="gpt2", bias=False, tie_embeddings=False, gelu="tanh"), "GPT2LMHeadModel"),
    "llama": (dict(arch="llama", bias=False), "LlamaForCausalLM"),
    "mistral": (dict(arch="llama", bias=False, attn_pattern="swa", swa_window=8), "MistralForCausalLM"),
    "qwen3": (dict(arch="llama", bias=False, qk_norm=True, n_kv_head=1, attn_head_dim=8), "Qwen3ForCausalLM"),
    "qwen2_swa": (dict(arch="llama", bias=False, qkv_bias=True, attn_pattern="swa", swa_window=8), "Qwen2ForCausalLM"),
    "sa_swa": (dict(arch="llama", bias=False, attn_pattern="sa_swa,full", swa_window=8), "EfficientAttentionForCausalLM"),
    "mlstm": (dict(arch="llama", bias=False, attn_pattern="swa,mlstm", swa_window=8), "EfficientAttentionForCausalLM"),
}


def make_run(folder, settings, seed=0):
    torch.manual_seed(seed)
    gpt = GPT(ModelConfig(**{**SHAPE, **settings})).eval()
    return gpt, save_run(gpt, folder)


@pytest.mark.e2e
@pytest.mark.parametrize("case", sorted(CASES))
def test_an_export_is_the_run_in_transformers(case, tmp_path, offline):
    settings, expected_class = CASES[case]
    gpt, run = make_run(tmp_path / "run", settings)
    folder = export_run(ExportConfig(out_dir=str(run)))
    record = json.loads((folder / "export.json").read_text())
    assert record["class"] == expected_class and record["step"] == 7 and record["verified_max_logit_diff"] <= 1e-4
    project = expected_class == "EfficientAttentionForCausalLM"
    assert os.path.exists(folder / "modeling_efficient_attention_gpt.py") == project
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=project).eval()
    assert type(hf).__name__ == expected_class
    if project:  # its layers are this project's already: python -m eval --hf= says to evaluate the run itself
        from eval.hf_model import load_pretrained_lm
        from runtime.pretrained import PretrainedError

        with pytest.raises(PretrainedError, match="evaluate the run's folder"):
            load_pretrained_lm(str(folder), {"attn_pattern": "full"})

    ids = torch.randint(0, 257, (2, BLOCK), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.manual_seed(0)  # sa_swa draws its permutations from torch's generator
        ours, _ = gpt(ids)
        torch.manual_seed(0)
        theirs = hf(ids).logits
    assert (ours - theirs).abs().max() <= 1e-5
    prompt = ids[:1, :10]
    torch.manual_seed(0)
    reference = gpt.generate(prompt, 30, temperature=0, use_cache=False)
    torch.manual_seed(0)
    assert torch.equal(hf.generate(prompt, max_new_tokens=30, do_sample=False), reference)

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    text = "the cat sat on the mat.\nunicode: é ü 猫 🐈"
    assert tokenizer(text)["input_ids"] == get_tokenizer("byte").encode(text)  # nothing added: no BOS in training
    assert tokenizer.bos_token_id == tokenizer.eos_token_id == 256

    # init_from=hf:FOLDER builds the same model as train.py does
    from runtime.pretrained import load_hf_model, load_pretrained_weights, pretrained_model_config

    m = ModelConfig(**{**SHAPE, **({"attn_pattern": "swa", "swa_window": 8} if case in ("mistral", "qwen2_swa") else {})})
    pretrained_model_config(load_hf_model(str(folder)).config, m)
    back = GPT(m).eval()
    assert load_pretrained_weights(back, load_hf_model(str(folder))) == []
    with torch.no_grad():
        torch.manual_seed(0)
        assert (back(ids)[0] - ours).abs().max() <= 1e-5


@pytest.mark.e2e
def test_stock_lm_eval_on_an_export_equals_the_adapter_on_the_run(tmp_path, offline):
    """`lm_eval --model hf --model_args pretrained=FOLDER,trust_remote_code=True`, the harness's own command in
    a fresh process where this project is importable only through PYTHONPATH, against this project's adapter on
    the run folder: the same numbers, and the model named by its folder."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from eval.lm_eval_adapter import EfficientAttentionLM

    gpt, run = make_run(tmp_path / "run", CASES["mlstm"][0])
    folder = export_run(ExportConfig(out_dir=str(run)))
    write_tasks(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    # stock lm_eval: nothing of this project is imported before it starts
    proc = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                           f"pretrained={folder},trust_remote_code=True,dtype=float32", "--tasks",
                           "tiny_mc,tiny_ppl,tiny_gen", "--include_path", str(tmp_path), "--device", "cpu",
                           "--batch_size", "2", "--output_path", str(tmp_path / "stock")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (stock_file,) = (tmp_path / "stock").rglob("results_*.json")
    stock = json.loads(stock_file.read_text())
    assert stock["model_name"] == str(folder) and stock["config"]["model"] == "hf"

    ours = lm_eval.simple_evaluate(model=EfficientAttentionLM(pretrained=str(run), device="cpu", batch_size=2),
                                   tasks=["tiny_mc", "tiny_ppl", "tiny_gen"], bootstrap_iters=0,
                                   task_manager=TaskManager(include_path=str(tmp_path)))
    assert ours["config"]["model"] == str(run)
    for task, metric in (("tiny_mc", "acc,none"), ("tiny_ppl", "bits_per_byte,none"),
                         ("tiny_ppl", "word_perplexity,none"), ("tiny_gen", "exact_match,none")):
        assert ours["results"][task][metric] == pytest.approx(stock["results"][task][metric], rel=1e-5), (task, metric)


def test_converted_tokenizers_encode_as_the_runs(tmp_path):
    import tiktoken
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from data.tokenizer import HFTokenizer, TiktokenTokenizer

    text = "The cat sat on the mat.  It's 2026!\n\nunicode: é 猫 🐈 <|endoftext|>"
    # a tiktoken encoding (GPT-2's pattern, ranks of a small byte-level BPE), as tiktoken's gpt2 is built
    ranks = {bytes([b]): b for b in range(256)}
    for pair in (b"th", b"the", b" t", b"at", b" the", b"an"):
        ranks[pair] = len(ranks)
    encoding = tiktoken.Encoding("tiny", mergeable_ranks=ranks, special_tokens={"<|endoftext|>": len(ranks)},
                                 pat_str=r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    class TinyTiktoken(TiktokenTokenizer):  # GPT-2's tokenizer needs a download: the same class, a local encoding
        def _load(self):
            return encoding

    tik = TinyTiktoken("tiny")
    # a tokenizer.json whose post-processor adds BOS (Llama-style): the run never saw it
    rust = Tokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    rust.train_from_iterator([SENTENCES * 3], trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    rust.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    rust.save(str(tmp_path / "tokenizer.json"))
    for ours in (get_tokenizer("byte"), tik, HFTokenizer(str(tmp_path / "tokenizer.json"))):
        converted = hf_tokenizer(ours)
        plain = text.replace("<|endoftext|>", "")  # the run's encoders read it as text, a transformers one as EOS
        assert converted(plain)["input_ids"] == ours.encode(plain), ours.name
        assert converted.decode(ours.encode(plain)) == plain
        assert converted.eos_token_id == converted.bos_token_id == ours.eot_id


@pytest.mark.e2e
def test_export_refuses_what_it_cannot_write_and_writes_nothing(tmp_path, capsys):
    assert main([f"--out_dir={tmp_path / 'none'}"]) == 1  # no checkpoint
    assert "no checkpoint" in capsys.readouterr().err
    _, run = make_run(tmp_path / "run", CASES["llama"][0])
    (run / "hf").mkdir()
    (run / "hf" / "notes.txt").write_text("mine")
    assert main([f"--out_dir={run}"]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert os.listdir(run / "hf") == ["notes.txt"]
    with pytest.raises(SystemExit) as exit_info:
        main([f"--out_dir={run}", "--format=onnx"])
    assert exit_info.value.code == 2
    assert main([f"--out_dir={run}", f"--to={tmp_path / 'exported'}"]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary folder left


def tree(folder):
    """Every file under folder with its bytes: what a tool must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.e2e
def test_overwrite_replaces_only_an_earlier_export_never_a_run_or_its_neighbours(tmp_path, capsys):
    parent = tmp_path / "parent"
    _, run = make_run(parent / "run", CASES["llama"][0])
    (run / "metrics.jsonl").write_text('{"step": 7, "train_loss": 1.0}\n')
    (parent / "sibling").mkdir()
    (parent / "sibling" / "notes.txt").write_text("a neighbour's file")
    before = tree(tmp_path)
    for to in (run, parent, parent / "sibling", tmp_path):  # the run, its parent, a sibling, the grandparent
        assert main([f"--out_dir={run}", f"--to={to}", "--overwrite=True"]) == 2
        err = capsys.readouterr().err
        assert "replaces only an earlier export" in err or "not an export this tool wrote" in err, err
        assert tree(tmp_path) == before  # nothing removed, nothing added
    (tmp_path / "afile").write_text("x")
    assert main([f"--out_dir={run}", f"--to={tmp_path / 'afile'}"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err

    # an earlier export is replaced; once it holds a file the export did not write, it is not
    exported = tmp_path / "exports" / "run"
    assert main([f"--out_dir={run}", f"--to={exported}"]) == 0
    record = json.loads((exported / "export.json").read_text())
    assert sorted(record["files"]) == sorted(tree(exported)) and "model.safetensors" in record["files"]
    mask = os.umask(0)
    os.umask(mask)
    assert {p.stat().st_mode & 0o777 for p in [exported, *exported.iterdir()]} == {0o777 & ~mask, 0o666 & ~mask}
    assert main([f"--out_dir={run}", f"--to={exported}", "--ckpt=best", "--overwrite=True"]) == 0
    (exported / "my_eval.json").write_text("{}")
    assert main([f"--out_dir={run}", f"--to={exported}", "--overwrite=True"]) == 2
    assert "my_eval.json" in capsys.readouterr().err and (exported / "my_eval.json").exists()
    assert [p.name for p in exported.parent.iterdir()] == ["run"]  # no temporary folder left


def test_an_export_gets_the_users_umask(tmp_path):
    from export import apply_umask

    folder = tmp_path / "made"
    folder.mkdir(mode=0o700)
    (folder / "model.safetensors").write_bytes(b"x")
    os.chmod(folder / "model.safetensors", 0o600)
    mask = os.umask(0o022)
    try:
        apply_umask(folder)
    finally:
        os.umask(mask)
    assert (folder.stat().st_mode & 0o777, (folder / "model.safetensors").stat().st_mode & 0o777) == (0o755, 0o644)


def test_a_run_folder_without_a_checkpoint_gets_a_command_that_works_there(tmp_path, capsys):
    """A run stopped before its first checkpoint: export says so, and the command it suggests is one the run
    folder accepts (a fresh run over it is refused unless it replaces the old one)."""
    from common.run_folder import RunFolderError, claim

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "train_loss": 5.0}\n')
    (run / "config.json").write_text("{}")
    assert main([f"--out_dir={run}"]) == 1  # no checkpoint: 1, as sample, eval and a resume exit
    err = capsys.readouterr().err
    assert "no checkpoint" in err and "--replace_run=True" in err and "Traceback" not in err
    with pytest.raises(RunFolderError):
        claim(run, fresh=True, replace=False)  # what the plain command would meet
    claim(run, fresh=True, replace=True).release()  # the suggested one is taken


@pytest.mark.e2e  # export records the git hash (a git process)
def test_an_sa_export_says_its_outputs_are_drawn_per_forward_and_the_deterministic_flag_fixes_them(tmp_path, offline,
                                                                                                     capsys):
    _, run = make_run(tmp_path / "run", CASES["sa_swa"][0])
    assert main([f"--out_dir={run}", f"--to={tmp_path / 'drawn'}"]) == 0
    said = capsys.readouterr().out
    assert "note: the exported model's outputs are drawn per forward: its sa layers draw a fresh permutation" in said
    assert "--sa_mode=deterministic" in json.loads((tmp_path / "drawn" / "export.json").read_text())["drawn_per_forward"]
    ids = torch.randint(0, 257, (1, BLOCK), generator=torch.Generator().manual_seed(1))
    logits = []
    for name in ("fixed_a", "fixed_b"):
        assert main([f"--out_dir={run}", f"--to={tmp_path / name}", "--sa_mode=deterministic"]) == 0
        assert "drawn per forward" not in capsys.readouterr().out
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name, trust_remote_code=True).eval()
        with torch.no_grad():
            logits += [hf(ids).logits, hf(ids).logits]  # no seed: nothing is drawn
    assert all(torch.equal(logits[0], other) for other in logits[1:])
    assert json.loads((tmp_path / "fixed_a" / "export.json").read_text())["inference_settings"] == \
        {"sa_mode": "deterministic"}
    assert main([f"--out_dir={run}", f"--to={tmp_path / 'bad'}", "--sa_mode=sometimes"]) == 2
    assert "sa_mode='sometimes'" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_an_export_into_a_read_only_folder_is_one_line(tmp_path, offline, capsys, monkeypatch):
    import export

    _, run = make_run(tmp_path / "run", CASES["llama"][0])
    to = tmp_path / "locked" / "hf"

    def read_only(prefix, dir):  # what a folder without write permission gives (the tests may run as root)
        raise PermissionError(13, "Permission denied", str(dir))

    monkeypatch.setattr(export.tempfile, "mkdtemp", read_only)
    assert main([f"--out_dir={run}", f"--to={to}"]) == 2
    said = capsys.readouterr().err
    assert said.startswith(f"error: cannot write the export at {to.parent}: Permission denied") and \
        said.count("\n") == 1
    assert not to.exists()
