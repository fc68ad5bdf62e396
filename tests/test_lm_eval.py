"""The lm-evaluation-harness adapter (eval/lm_eval_adapter.py) against independent computations, and a full
lm_eval.simple_evaluate run on local tasks. Offline: no dataset or model is downloaded."""

import json
import math
import socket
import sys

import pytest
import torch
import torch.nn.functional as F

from config import ModelConfig
from data.tokenizer import get_tokenizer
from model import GPT

import lm_eval  # noqa: E402  (requirements-eval.txt)
from lm_eval.api.instance import Instance  # noqa: E402

from eval.lm_eval_adapter import MODEL_NAME, CheckpointLM  # noqa: E402

SENTENCES = "the cat sat on the mat. the dog ran to the park. a bird flew over the tree. "
BLOCK = 64
EOT = 256


def tiny_gpt(arch="gpt2", seed=0):
    torch.manual_seed(seed)
    return GPT(ModelConfig(arch=arch, n_layer=2, n_head=2, n_embd=32, block_size=BLOCK, vocab_size=320))


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer("byte")


@pytest.fixture(scope="module")
def model(tok):
    """A tiny learned-position GPT trained for a few seconds on three repeated sentences, so that greedy
    decoding writes sentences ending in '.' (and end-of-text after the third) and some continuations are
    greedy."""
    model = tiny_gpt()
    data = torch.tensor((tok.encode(SENTENCES) + [EOT]) * 20)  # end-of-text after every third sentence
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    for _ in range(200):
        starts = torch.randint(0, len(data) - BLOCK - 1, (16,), generator=gen)
        x = torch.stack([data[s:s + BLOCK] for s in starts])
        y = torch.stack([data[s + 1:s + BLOCK + 1] for s in starts])
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5, "the tiny model did not learn its sentences"
    return model.eval()


def request(kind, *args):
    return Instance(request_type=kind, doc={}, arguments=tuple(args), idx=0)


@torch.no_grad()
def reference_logprob(model, context_ids, continuation_ids, limit=BLOCK):
    """Sum of log p(continuation | context) from one plain forward pass, cut from the left to limit inputs."""
    seq = list(context_ids) + list(continuation_ids)
    if limit is not None:
        seq = seq[-(limit + 1):]
    logits, _ = model(torch.tensor([seq[:-1]]))
    logprobs = F.log_softmax(logits[0].float(), dim=-1)
    n = len(continuation_ids)
    positions = range(len(seq) - 1 - n, len(seq) - 1)
    total = sum(float(logprobs[p, seq[p + 1]]) for p in positions)
    greedy = all(int(logits[0, p].argmax()) == seq[p + 1] for p in positions)
    return total, greedy


@torch.no_grad()
def reference_rolling(model, tokens, window):
    """Every token predicted once, `window` at a time; each window sees the `window` inputs before its end
    (the first starts from end-of-text)."""
    full = [EOT] + list(tokens)  # full[j] is the input that predicts tokens[j]
    total, start = 0.0, 0
    while start < len(tokens):
        end = min(start + window, len(tokens))
        lo = max(0, end - window)
        logits, _ = model(torch.tensor([full[lo:end]]))
        logprobs = F.log_softmax(logits[0].float(), dim=-1)
        total += sum(float(logprobs[j - lo, tokens[j]]) for j in range(start, end))
        start = end
    return total


def reference_generate(model, tok, context_ids, max_new, until):
    out = model.generate(torch.tensor([context_ids]), max_new, temperature=0, use_cache=False)
    new = out[0, len(context_ids):].tolist()
    if EOT in new:
        new = new[:new.index(EOT)]
    text = tok.decode(new)
    for stop in until:
        text = text.split(stop)[0]
    return text


def test_loglikelihood_matches_plain_forward(model, tok):
    long_context = (SENTENCES * 3).rstrip()  # 224 bytes: cut from the left
    assert len(tok.encode(long_context)) > BLOCK
    cases = [  # (context, continuation, context ids, continuation ids the adapter must score)
        ("the cat sat on the", " mat.", tok.encode("the cat sat on the"), tok.encode(" mat.")),
        ("the cat sat on the", " tree.", tok.encode("the cat sat on the"), tok.encode(" tree.")),
        ("", "the dog ran", [EOT], tok.encode("the dog ran")),
        ("a bird flew over the ", "tree.", tok.encode("a bird flew over the"), tok.encode(" tree.")),
        (long_context, "the cat", tok.encode(long_context), tok.encode("the cat")),
        ("the dog ran to the", "", None, None),
    ]
    lm = CheckpointLM.from_model(model, tok, batch_size=2)  # several batches, reordered by length
    got = lm.loglikelihood([request("loglikelihood", c, x) for c, x, _, _ in cases], disable_tqdm=True)
    assert len(got) == len(cases)
    for (context, continuation, ctx_ids, cont_ids), (logprob, greedy) in zip(cases, got):
        assert isinstance(logprob, float) and isinstance(greedy, bool)
        if cont_ids is None:
            assert (logprob, greedy) == (0.0, True)  # nothing to score
            continue
        ref, ref_greedy = reference_logprob(model, ctx_ids, cont_ids)
        assert logprob == pytest.approx(ref, abs=1e-4), (context[-30:], continuation)
        assert greedy == ref_greedy, (context[-30:], continuation)
    assert got[0][1] and not got[1][1]  # the trained model completes its sentence, not another one
    assert got[0][0] > got[1][0]
    # the long context keeps its last 64 + 1 - 7 tokens ("the cat" is 7)
    kept = tok.encode(long_context)[-(BLOCK + 1 - 7):]
    assert got[4][0] == pytest.approx(reference_logprob(model, kept, tok.encode("the cat"), limit=None)[0], abs=1e-4)


def test_loglikelihood_rolling_windows(model, tok):
    long_text = (SENTENCES * 3)[:200]
    short_text = "the cat sat on the mat."
    lm = CheckpointLM.from_model(model, tok, batch_size=3)
    assert lm.max_length == BLOCK
    got = lm.loglikelihood_rolling([request("loglikelihood_rolling", long_text),
                                    request("loglikelihood_rolling", short_text),
                                    request("loglikelihood_rolling", "")], disable_tqdm=True)
    assert got[0] == pytest.approx(reference_rolling(model, tok.encode(long_text), BLOCK), abs=1e-3)
    # later windows are conditioned on the text before them: scoring each window after end-of-text alone
    # gives a clearly different total
    ids = tok.encode(long_text)
    no_context = sum(reference_logprob(model, [EOT], ids[i:i + BLOCK])[0] for i in range(0, len(ids), BLOCK))
    assert abs(got[0] - no_context) > 1.0
    single = reference_logprob(model, [EOT], tok.encode(short_text))[0]
    assert got[1] == pytest.approx(single, abs=1e-4)
    (ll_empty_context, _), = lm.loglikelihood([request("loglikelihood", "", short_text)], disable_tqdm=True)
    assert got[1] == pytest.approx(ll_empty_context, abs=1e-4)
    assert got[2] == 0.0
    # max_length shrinks the windows
    small = CheckpointLM.from_model(model, tok, max_length=16).loglikelihood_rolling(
        [request("loglikelihood_rolling", long_text)], disable_tqdm=True)
    assert small[0] == pytest.approx(reference_rolling(model, tok.encode(long_text), 16), abs=1e-3)


def test_rope_model_has_no_position_limit(tok):
    """RoPE: loglikelihood is not cut; rolling windows default to block_size."""
    model = tiny_gpt("llama", seed=1).eval()
    assert model.wpe is None
    lm = CheckpointLM.from_model(model, tok, batch_size=4)
    context = (SENTENCES * 2).rstrip()  # 149 tokens, more than block_size
    (logprob, _), = lm.loglikelihood([request("loglikelihood", context, " the end")], disable_tqdm=True)
    ref = reference_logprob(model, tok.encode(context), tok.encode(" the end"), limit=None)[0]
    assert logprob == pytest.approx(ref, abs=1e-4)
    # nor is a generation prompt cut
    prompts = []
    real_generate = model.generate

    def spy_generate(idx, max_new_tokens, **kwargs):
        prompts.append(idx[0].tolist())
        return real_generate(idx, max_new_tokens, **kwargs)

    model.generate = spy_generate
    try:
        (generated,) = lm.generate_until([request("generate_until", context, {"until": [], "max_gen_toks": 8})],
                                         disable_tqdm=True)
    finally:
        del model.generate
    assert prompts == [tok.encode(context)]
    assert generated == reference_generate(model, tok, tok.encode(context), 8, [])
    text = (SENTENCES * 3)[:150]
    (rolling,) = lm.loglikelihood_rolling([request("loglikelihood_rolling", text)], disable_tqdm=True)
    assert rolling == pytest.approx(reference_rolling(model, tok.encode(text), BLOCK), abs=1e-3)


def test_generate_until_matches_greedy_generate(model, tok):
    lm = CheckpointLM.from_model(model, tok)
    prompt = "the dog ran to"
    full = reference_generate(model, tok, tok.encode(prompt), 30, [])
    assert "." in full, f"the tiny model should end its sentence: {full!r}"
    long_prompt = (SENTENCES * 3)[:200]
    reqs = [
        (prompt, {"until": ["."], "max_gen_toks": 30, "do_sample": False}),
        (prompt, {"until": ["zzz"], "max_gen_toks": 30, "temperature": 0}),
        (prompt, {"until": [], "max_gen_toks": 50}),  # two chunks of generation
        (long_prompt, {"until": ["\n"], "max_gen_toks": 10}),
        ("", {"until": ["."], "max_gen_toks": 20}),
    ]
    got = lm.generate_until([request("generate_until", c, k) for c, k in reqs], disable_tqdm=True)
    assert all(isinstance(g, str) for g in got)
    assert got[0] == full.split(".")[0] and got[0] and "." not in got[0]
    assert got[1] == full
    # 50 new tokens leave room for 64 - 50 = 14 prompt tokens (this prompt's length) in one KV cache
    assert got[2] == reference_generate(model, tok, tok.encode(prompt)[-14:], 50, [])
    assert got[3] == reference_generate(model, tok, tok.encode(long_prompt)[-(BLOCK - 10):], 10, ["\n"])
    assert got[4] == reference_generate(model, tok, [EOT], 20, ["."])
    # end-of-text ends the generation even without stop strings
    eot_prompt = tok.encode("a bird flew over the")
    assert EOT in model.generate(torch.tensor([eot_prompt]), 30, temperature=0)[0, len(eot_prompt):].tolist()
    (ended,) = lm.generate_until([request("generate_until", "a bird flew over the", {"until": [], "max_gen_toks": 30})],
                                 disable_tqdm=True)
    assert ended == reference_generate(model, tok, eot_prompt, 30, []) and ended.endswith(". ")
    # a stop string ends the generation early, not only the returned text
    steps = []
    real_generate = model.generate

    def counting_generate(idx, max_new_tokens, **kwargs):
        steps.append(max_new_tokens)
        return real_generate(idx, max_new_tokens, **kwargs)

    model.generate = counting_generate
    try:
        (early,) = lm.generate_until([request("generate_until", prompt, {"until": ["."], "max_gen_toks": 200})],
                                     disable_tqdm=True)
    finally:
        del model.generate
    assert early == got[0] and sum(steps) <= 40, steps
    # an untrained model's output depends on every context token, so cutting the prompt visibly matters
    raw = tiny_gpt(seed=2).eval()
    (cut,) = CheckpointLM.from_model(raw, tok).generate_until(
        [request("generate_until", long_prompt, {"until": [], "max_gen_toks": 10})], disable_tqdm=True)
    long_ids = tok.encode(long_prompt)
    assert cut == reference_generate(raw, tok, long_ids[-(BLOCK - 10):], 10, [])
    assert cut != reference_generate(raw, tok, long_ids, 10, [])
    # sampling follows model.generate's sampling with the same seed
    torch.manual_seed(123)
    (sampled,) = lm.generate_until([request("generate_until", prompt,
                                             {"until": [], "max_gen_toks": 20, "do_sample": True,
                                              "temperature": 1.5})], disable_tqdm=True)
    torch.manual_seed(123)
    out = model.generate(torch.tensor([tok.encode(prompt)]), 20, temperature=1.5)[0, len(prompt):].tolist()
    assert sampled == tok.decode(out[:out.index(EOT)] if EOT in out else out)
    assert sampled != reference_generate(model, tok, tok.encode(prompt), 20, [])


def test_constructors_and_registry(model, tok, tmp_path):
    from checkpoint import save_checkpoint
    from config import Config

    from lm_eval.api.registry import get_model

    assert get_model(MODEL_NAME) is CheckpointLM
    cfg = Config()
    cfg.model = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=BLOCK, vocab_size=320)
    save_checkpoint({"model": model.state_dict(), "config": cfg.to_dict(), "step": 7, "tokenizer": "byte"},
                    tmp_path / "ckpt_best.pt")
    assert CheckpointLM.create_from_arg_string(f"out_dir={tmp_path}", {"batch_size": 5}).batch_size == 5
    lm = CheckpointLM.create_from_arg_string(f"out_dir={tmp_path},ckpt=best,batch_size=8",
                                             {"batch_size": 1, "device": "cpu", "max_batch_size": None})
    assert lm.batch_size == 8 and lm.max_length == BLOCK and lm.eot_token_id == EOT
    assert lm.get_model_info()["step"] == 7
    reqs = [request("loglikelihood", "the cat sat on the", " mat.")]
    assert lm.loglikelihood(reqs, disable_tqdm=True) == CheckpointLM.from_model(model, tok).loglikelihood(
        reqs, disable_tqdm=True)
    with pytest.raises(ValueError, match="max_length"):
        CheckpointLM.from_model(model, tok, max_length=BLOCK + 1)


def test_missing_lm_eval_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now raises ImportError
    for name in [m for m in sys.modules if m.startswith("lm_eval.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "eval.lm_eval_adapter")
    with pytest.raises(ImportError, match=r"pip install -r requirements-eval\.txt"):
        __import__("eval.lm_eval_adapter")


MC_ITEMS = [
    ("the cat sat on the", ["mat.", "park.", "tree."], 0),
    ("the dog ran to the", ["mat.", "park.", "tree."], 1),
    ("a bird flew over the", ["park.", "tree.", "mat."], 1),
    ("the cat sat", ["on the mat.", "over the tree."], 0),
    ("the dog", ["ran to the park.", "sat on the mat."], 0),
    ("a bird", ["sat on the park.", "flew over the tree."], 1),
]
PPL_DOCS = [SENTENCES * 2, "the cat sat on the mat.", "a bird flew over the park. the dog sat."]
GEN_ITEMS = [("the cat sat", "on the mat"), ("the dog ran to", "the park"), ("a bird", "flew over the tree")]


@pytest.fixture
def offline(monkeypatch):
    """No network: the hub libraries are told so, and any TCP/UDP connection attempt fails the test."""
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for attr in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if hasattr(datasets.config, attr):
            monkeypatch.setattr(datasets.config, attr, True)
    attempts = []
    real_connect = socket.socket.connect

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            attempts.append(address)
            raise OSError(f"network access during an offline test: {address}")
        return real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    yield
    assert not attempts, f"tried to reach {attempts}"


def write_tasks(folder):
    data = folder / "data"
    data.mkdir()

    def jsonl(name, rows):
        path = data / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\n  cache_dir: {cache}\ntest_split: test\n"
    cache = folder / "hf_cache"
    mc = jsonl("mc", [{"question": q, "choices": c, "answer": a} for q, c, a in MC_ITEMS])
    (folder / "tiny_mc.yaml").write_text(
        "task: tiny_mc\n" + common.format(path=mc, cache=cache) +
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    ppl = jsonl("ppl", [{"text": t} for t in PPL_DOCS])
    (folder / "tiny_ppl.yaml").write_text(
        "task: tiny_ppl\n" + common.format(path=ppl, cache=cache) +
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    gen = jsonl("gen", [{"prompt": p, "answer": a} for p, a in GEN_ITEMS])
    (folder / "tiny_gen.yaml").write_text(
        "task: tiny_gen\n" + common.format(path=gen, cache=cache) +
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: ' {{answer}}'\n"
        "generation_kwargs:\n  until: ['.']\n  max_gen_toks: 24\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


def test_simple_evaluate_on_local_tasks(model, tok, tmp_path, offline):
    from lm_eval.tasks import TaskManager

    write_tasks(tmp_path)
    lm = CheckpointLM.from_model(model, tok, batch_size=4)
    results = lm_eval.simple_evaluate(model=lm, tasks=["tiny_mc", "tiny_ppl", "tiny_gen"],
                                      task_manager=TaskManager(include_path=str(tmp_path)),
                                      bootstrap_iters=0, log_samples=True)
    res = results["results"]
    assert results["n-samples"]["tiny_mc"]["effective"] == len(MC_ITEMS) == len(results["samples"]["tiny_mc"])
    assert results["n-samples"]["tiny_ppl"]["effective"] == len(PPL_DOCS)
    assert results["n-samples"]["tiny_gen"]["effective"] == len(GEN_ITEMS)

    # multiple choice: lm_eval asks for " " + choice after the question; the best-scored choice is the answer
    acc = res["tiny_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    picks = []
    for question, choices, answer in MC_ITEMS:
        scores = [reference_logprob(model, tok.encode(question), tok.encode(" " + c))[0] for c in choices]
        picks.append(max(range(len(choices)), key=scores.__getitem__) == answer)
    assert acc == pytest.approx(sum(picks) / len(picks))
    assert acc >= 0.5  # the trained model knows its sentences

    # perplexity: bits per byte from independently computed rolling log-likelihoods
    lls = [reference_rolling(model, tok.encode(t), BLOCK) for t in PPL_DOCS]
    n_bytes = sum(len(t.encode()) for t in PPL_DOCS)
    assert res["tiny_ppl"]["bits_per_byte,none"] == pytest.approx(-sum(lls) / n_bytes / math.log(2), rel=1e-4)

    # generation: greedy continuation up to '.', compared with the target
    expected = [reference_generate(model, tok, tok.encode(p), 24, ["."]) == " " + a for p, a in GEN_ITEMS]
    assert res["tiny_gen"]["exact_match,none"] == pytest.approx(sum(expected) / len(expected))
