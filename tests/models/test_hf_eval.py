"""python -m eval --hf: this codebase's tasks on a Hugging Face causal LM (a small random Qwen3 saved with
save_pretrained, a byte-level BPE tokenizer trained here), with a variant in its attention."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

from conftest import REPO
from scripts.gpucheck import tiny_hf
from data.meta import open_tokens
from eval import ppl as ppl_task
from eval.hf_model import load_pretrained_lm


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    """(model folder with its tokenizer.json, data folder prepared with that tokenizer): a small random Qwen3
    saved with save_pretrained, as the GPU check's pretrained step builds it."""
    return tiny_hf.build_tiny_hf_model(tmp_path_factory.mktemp("hf"))


def run_eval(*args):
    return subprocess.run([sys.executable, "-m", "eval", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.e2e
def test_tasks_run_on_the_model_with_its_tokenizer_and_full_pattern_scores_as_the_model_itself(local_model, tmp_path):
    folder, data_dir = local_model
    out = tmp_path / "sa"
    diagnostics = ["--diag_samples=2", "--diag_distances=16,32", "--diag_block=64", "--diag_half=32",
                   "--diag_probes=needle,bridge_window", "--hf_context=128", "--progress=False"]
    proc = run_eval(f"--hf={folder}", f"--data_dir={data_dir}", f"--out_dir={out}", "--attn_pattern=sa,sa,sa,full",
                    "--swa_window=16", "--tasks=ppl,niah,diagnostics", "--limit=2", "--niah_samples=2",
                    "--niah_kinds=niah_single_1", "--niah_lengths=256", "--niah_gen_tokens=8", *diagnostics)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for task in ("ppl", "niah", "diagnostics"):
        report = json.loads((out / "eval" / f"{task}.json").read_text())
        assert report["provenance"]["ckpt"] == str(folder)
        assert report["provenance"]["attention"] == {"hf_decode": "full", "attn_pattern": "sa,sa,sa,full",
                                                     "swa_window": 16}
    assert "model " + str(folder) in (out / "eval" / "summary.md").read_text()

    # full attention through the patched model: the perplexity of the unpatched transformers model
    proc = run_eval(f"--hf={folder}", f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'full'}",
                    "--attn_pattern=full", "--tasks=ppl,diagnostics", "--ppl_lengths=64", "--ppl_max_tokens=2000",
                    *diagnostics)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the folders compare as runs: the same probes, paired by example
    from scripts.compare import load_local_run, paired

    runs = [load_local_run(tmp_path / name) for name in ("full", "sa")]
    assert runs[1]["config"]["model"]["attn_pattern"] == "sa,sa,sa,full"
    assert runs[1]["config"]["train"]["init_from"] == f"hf:{folder}"
    examples = runs[1]["evals"]["diagnostics"]["per_example"]
    assert {e["probe"] for e in examples} == {"needle", "bridge_window"}
    assert paired(*runs, "diagnostics")["all"]["n"] == len(examples)
    measured = json.loads((tmp_path / "full" / "eval" / "ppl.json").read_text())["results"]["rows"][0]
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    docs = ppl_task.documents(open_tokens(str(data_dir), "val"), json.loads((data_dir / "meta.json").read_text())
                              ["eot_id"], 2000)
    nll, count = 0.0, 0
    with torch.no_grad():
        for inputs, targets in ppl_task.windows(docs, 64):
            logits = reference(torch.from_numpy(np.asarray(inputs))[None]).logits[0]
            nll += float(torch.nn.functional.cross_entropy(logits, torch.from_numpy(np.asarray(targets)), reduction="sum"))
            count += len(targets)
    assert measured["tokens"] == count
    assert math.isclose(measured["nll"], nll / count, rel_tol=1e-5)


def test_windows_switch_on_the_same_weights_and_generation_follows_hf_decode(local_model):
    folder, _ = local_model
    model, tokenizer = load_pretrained_lm(str(folder), {"attn_pattern": "swa", "swa_window": 8}, hf_decode="variant")
    assert tokenizer.eot_id == 0 and model.config.block_size == 2048 and model.wpe is None
    idx = torch.randint(0, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        w8 = model(idx)[0]
        w4 = model.with_changes(swa_window=4)(idx)[0]
        assert not torch.allclose(w8, w4, atol=1e-4)
        torch.testing.assert_close(model.with_changes()(idx)[0], w8)  # back to the base settings
        # hf_decode=variant: cached greedy decoding equals re-running the whole sequence under swa each step
        cached = model.generate(idx, 5, temperature=0, use_cache=True)
        rerun = model.generate(idx, 5, temperature=0, use_cache=False)
    assert torch.equal(cached, rerun)


@pytest.mark.parametrize("args, status, message", [
    (["--attn_pattern=sa"], 2, "--hf needs --data_dir"),
    (["--hf=MISSING", "--data_dir=DATA"], 1, "cannot load"),
    (["--data_dir=EMBEDDED"], 1, "prepare the text with --tokenizer="),
    (["--data_dir=DATA", "--attn_pattern=sa_swa"], 1, "parameters or state of its own"),
])
def test_bad_hf_invocations_exit_with_one_line(local_model, tmp_path, capsys, args, status, message):
    from eval.__main__ import main

    folder, data_dir = local_model
    places = {"MISSING": str(tmp_path / "missing"), "DATA": str(data_dir), "EMBEDDED": str(REPO / "data" / "embedded_byte")}
    for key, value in places.items():
        args = [arg.replace(key, value) for arg in args]
    if not any(arg.startswith("--hf=") for arg in args):
        args = [f"--hf={folder}", *args]
    with pytest.raises(SystemExit) as exit_:
        main([*args, f"--out_dir={tmp_path / 'out'}"])
    assert exit_.value.code == status and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing written


def test_model_settings_without_hf_are_refused():
    from config import ConfigError
    from eval.__main__ import parse

    with pytest.raises(ConfigError, match="model settings apply to --hf models"):
        parse(["--out_dir=out/run", "--attn_pattern=sa"])


def test_lm_eval_adapter_scores_the_model_with_its_variant(local_model):
    from lm_eval.api.instance import Instance

    from eval.lm_eval_adapter import EfficientAttentionLM

    folder, _ = local_model
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=("the old house stood", " on the hill"), idx=0)]
    full = EfficientAttentionLM.create_from_arg_string(f"pretrained={folder},attn_pattern=full",
                                                       {"batch_size": 2, "device": "cpu"})
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    context, continuation = full._encode_pair(*requests[0].arguments)
    with torch.no_grad():
        logits = reference(torch.tensor([context + continuation])).logits[0, len(context) - 1:-1]
    expected = float(torch.log_softmax(logits, -1)[torch.arange(len(continuation)), torch.tensor(continuation)].sum())
    assert math.isclose(full.loglikelihood(requests)[0][0], expected, rel_tol=1e-5)
    sparse = EfficientAttentionLM.create_from_arg_string(
        f"pretrained={folder},attn_pattern=block:block:block:full,block_len=2", {"device": "cpu"})
    assert sparse.get_model_info()["attention"]["attn_pattern"] == "block,block,block,full"
    assert not math.isclose(sparse.loglikelihood(requests)[0][0], expected, rel_tol=1e-3)


def test_cached_decoding_on_a_sliding_window_checkpoint_follows_the_attention_used(tmp_path):
    """A Mistral-type config has its own sliding window, which transformers' cache would keep to: under full
    attention (or a variant reaching past it) every cached decode step must equal the uncached forward."""
    from eval.hf_model import VariantLM

    config = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                                        max_position_embeddings=128)
    torch.manual_seed(0)
    for settings in ({"attn_pattern": "full"}, {"attn_pattern": "swa", "swa_window": 24}):
        model = VariantLM(transformers.MistralForCausalLM(config).eval(), settings, "variant", 128)
        ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            uncached = model.hf(ids, use_cache=False).logits
            cache = model.hf(ids[:, :4], use_cache=True).past_key_values
            for t in range(4, ids.size(1)):  # one decode step per position, past the config's window of 8
                step = model.hf(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
                cache = step.past_key_values
                assert torch.allclose(step.logits[0, -1], uncached[0, t], atol=1e-5), (settings, t)
        assert torch.equal(model.generate(ids[:, :5], 30, temperature=0),
                           model.generate(ids[:, :5], 30, temperature=0, use_cache=False))


@pytest.mark.e2e
def test_window_sweep_writes_the_table_and_the_plots(local_model, tmp_path, offline):
    from scripts.sa.hf_window_sweep import main
    from helpers import MC_ITEMS, write_tasks

    folder, _ = local_model
    write_tasks(tmp_path)
    out = tmp_path / "sweep"
    main([f"--hf={folder}", "--tasks=tiny_mc,tiny_gen", f"--include_path={tmp_path}", "--windows=4,8",
          "--moba_blocks=2,4", "--moba_topk=2", f"--out={out}", "--device=cpu", "--batch_size=4"])
    results = json.loads((out / "results.json").read_text())
    cells = [(row["mode"], row["window"]) for row in results["rows"]]
    assert cells == [("full", None), ("swa", 4), ("sa", 4), ("swa", 8), ("sa", 8), ("moba", 4), ("moba", 8)]
    full = results["rows"][0]
    assert full["metrics"] == {"tiny_mc": "acc,none", "tiny_gen": "exact_match,none"}
    assert full["scores"]["tiny_mc"] in {i / len(MC_ITEMS) for i in range(len(MC_ITEMS) + 1)}
    table = (out / "table.md").read_text()
    assert "| mode | window | tiny_mc | tiny_gen | average |" in table and "| moba | 8 |" in table
    for name in ("accuracy_vs_window.png", "accuracy_by_task.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a rerun of one cell into the same folder keeps the others; one under another setting is refused
    main([f"--hf={folder}", "--tasks=tiny_mc,tiny_gen", f"--include_path={tmp_path}", "--windows=4",
          "--moba_blocks=", "--modes=swa", f"--out={out}", "--device=cpu", "--batch_size=4"])
    again = json.loads((out / "results.json").read_text())["rows"]
    assert sorted((row["mode"], row["window"] or 0) for row in again) == sorted((m, w or 0) for m, w in cells)
    with pytest.raises(SystemExit) as refused:
        main([f"--hf={folder}", "--tasks=tiny_mc,tiny_gen", f"--include_path={tmp_path}", "--windows=4",
              "--modes=swa", f"--out={out}", "--device=cpu", "--limit=1"])
    assert refused.value.code == 2
    assert json.loads((out / "results.json").read_text())["rows"] == again


@pytest.mark.parametrize("hf_decode, last_forward", [("full", 40), ("variant", 42)])
def test_sa_decodes_over_the_full_cache_or_reruns_the_sequence(local_model, hf_decode, last_forward):
    folder, _ = local_model
    model, _ = load_pretrained_lm(str(folder), {"attn_pattern": "sa", "swa_window": 8}, hf_decode=hf_decode)
    idx = torch.randint(0, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    model.generate(idx, 3, temperature=0, use_cache=True)
    # full: the prompt's forward drew the last permutation, then steps over the cache; variant: each step re-ran
    # the whole sequence under a new permutation, the last one over 42 tokens
    assert model.mixers[0].last_order.shape[-1] == last_forward
