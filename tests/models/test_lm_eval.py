"""The lm-evaluation-harness adapter (eval/lm_eval_adapter.py) against independent computations, and a full
lm_eval.simple_evaluate run on local tasks. Offline: no dataset or model is downloaded."""

import math
import sys

import pytest
import torch
import torch.nn.functional as F

from config import ModelConfig
from data.tokenizer import get_tokenizer
from helpers import GEN_ITEMS, MC_ITEMS, PPL_DOCS, SENTENCES, save_run, write_tasks
from model import GPT

import lm_eval  # noqa: E402  (requirements-eval.txt)
from lm_eval.api.instance import Instance  # noqa: E402

from eval.lm_eval_adapter import MODEL_NAME, EfficientAttentionLM  # noqa: E402

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


@pytest.fixture(scope="module")
def run(model, tmp_path_factory):
    return save_run(model, tmp_path_factory.mktemp("run"))


def adapter(folder, **kwargs):
    return EfficientAttentionLM(pretrained=str(folder), device="cpu", **{"batch_size": 2, **kwargs})


def test_run_requests_equal_plain_forwards_of_the_model(model, tok, run):
    """A run's checkpoint through lm_eval's HFLM: each request type against this project's own GPT, scored by
    hand. The byte tokenizer encodes context + continuation as the two apart; an empty context and the rolling
    windows are conditioned on end-of-text (the run's BOS); contexts are cut from the left to block_size."""
    lm = adapter(run)
    assert lm.max_length == BLOCK and lm.prefix_token_id == EOT and lm.eot_token_id == EOT
    long_context = (SENTENCES * 3).rstrip()
    cases = [("the cat sat on the", " mat.", tok.encode("the cat sat on the")),
             ("the cat sat on the", " tree.", tok.encode("the cat sat on the")),
             ("", "the dog ran", [EOT]),
             ("the ca", "t sat", tok.encode("the ca")),
             (long_context, "the cat", tok.encode(long_context))]
    got = lm.loglikelihood([request("loglikelihood", c, x) for c, x, _ in cases], disable_tqdm=True)
    for (context, continuation, ctx_ids), (logprob, greedy) in zip(cases, got):
        ref, ref_greedy = reference_logprob(model, ctx_ids, tok.encode(continuation))
        assert logprob == pytest.approx(ref, abs=1e-4) and greedy == ref_greedy, (context[-20:], continuation)
    assert got[0][1] and not got[1][1] and got[0][0] > got[1][0]  # the trained model knows its sentence

    long_text = (SENTENCES * 3)[:200]
    rolling = lm.loglikelihood_rolling([request("loglikelihood_rolling", long_text),
                                        request("loglikelihood_rolling", "the cat sat on the mat.")], disable_tqdm=True)
    assert rolling[0] == pytest.approx(reference_rolling(model, tok.encode(long_text), BLOCK), abs=1e-3)
    assert rolling[1] == pytest.approx(reference_logprob(model, [EOT], tok.encode("the cat sat on the mat."))[0],
                                       abs=1e-4)
    small = adapter(run, max_length=16).loglikelihood_rolling([request("loglikelihood_rolling", long_text)],
                                                              disable_tqdm=True)
    assert small[0] == pytest.approx(reference_rolling(model, tok.encode(long_text), 16), abs=1e-3)

    prompt = "the dog ran to"
    full = reference_generate(model, tok, tok.encode(prompt), 30, [])
    assert "." in full
    reqs = [(prompt, {"until": ["."], "max_gen_toks": 30, "do_sample": False}),
            ("a bird", {"until": ["."], "max_gen_toks": 30}),  # batched with the first: left-padded
            (prompt, {"until": ["zzz"], "max_gen_toks": 30, "temperature": 0}),
            (long_prompt := (SENTENCES * 3)[:200], {"until": ["\n"], "max_gen_toks": 10})]
    gen = lm.generate_until([request("generate_until", c, k) for c, k in reqs], disable_tqdm=True)
    assert gen[0] == full.split(".")[0] and gen[0]
    assert gen[1] == reference_generate(model, tok, tok.encode("a bird"), 30, ["."])
    assert gen[2] == full.split("zzz")[0]
    assert gen[3] == reference_generate(model, tok, tok.encode(long_prompt)[-(BLOCK - 10):], 10, ["\n"])


def test_cached_generation_of_a_run_equals_uncached(tok, tmp_path):
    """generate() through transformers keeps the layers' own caches (hf_gpt.GPTCache); a recurrent and a
    windowed layer decode as the whole sequence re-run would."""
    torch.manual_seed(3)
    gpt = GPT(ModelConfig(arch="llama", n_layer=2, n_head=2, n_embd=32, block_size=BLOCK, vocab_size=320,
                          attn_pattern="swa,mlstm", swa_window=8, bias=False)).eval()
    from runtime.hf_gpt import EfficientAttentionForCausalLM

    hf, _ = EfficientAttentionForCausalLM.from_run(save_run(gpt, tmp_path / "run"))
    ids = torch.tensor([tok.encode("the cat sat on")])
    cached = hf.generate(ids, max_new_tokens=30, do_sample=False, use_cache=True)
    assert torch.equal(cached, hf.generate(ids, max_new_tokens=30, do_sample=False, use_cache=False))
    assert torch.equal(cached, gpt.generate(ids, 30, temperature=0, use_cache=False))


def test_results_name_the_model_and_settings_are_checked(model, run, tmp_path):
    from lm_eval.api.registry import get_model

    assert get_model(MODEL_NAME) is EfficientAttentionLM
    lm = EfficientAttentionLM.create_from_arg_string(f"pretrained={run},ckpt=best,batch_size=8",
                                                     {"batch_size": 1, "device": "cpu", "max_batch_size": None})
    assert lm.batch_size == 8 and lm.pretrained == str(run)
    info = lm.get_model_info()
    assert info["step"] == 7 and info["run"] == str(run) and info["model_num_parameters"] == model.num_params()
    with pytest.raises(ValueError, match="attention it was trained with"):
        adapter(run, swa_window=8)
    # sa draws its permutation over the padded length: HFLM's right-padded batches would change its edges
    sa = save_run(GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=BLOCK, vocab_size=320,
                                  attn_pattern="sa,full", swa_window=8)), tmp_path / "sa")
    assert adapter(sa, batch_size=4).batch_size == 1 and adapter(run, batch_size=4).batch_size == 4


def test_missing_lm_eval_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now raises ImportError
    for name in [m for m in sys.modules if m.startswith("lm_eval.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "eval.lm_eval_adapter")
    with pytest.raises(ImportError, match=r"pip install -r requirements-eval\.txt"):
        __import__("eval.lm_eval_adapter")


# ---- a Hugging Face model with attention unchanged: stock HFLM is the reference --------------------------

def tiny_hf_model(folder, kind: str):
    """A small random Llama whose tokenizer adds BOS (<s>, as Llama's and Mistral's do), or a Qwen3 whose
    tokenizer adds nothing and ends text with <|im_end|> (a chat tokenizer's EOS): BPE trained here."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder.mkdir(parents=True)
    specials = ["<s>", "</s>"] if kind == "llama" else ["<|endoftext|>", "<|im_end|>"]
    rust = Tokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    rust.train_from_iterator([SENTENCES * 4], trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if kind == "llama":
        rust.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>", eos_token="</s>")
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                                          max_position_embeddings=48, bos_token_id=0, eos_token_id=1)
    else:
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="<|im_end|>",
                                                         pad_token="<|endoftext|>")
        config = transformers.Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=320,
                                          max_position_embeddings=48, eos_token_id=1)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_hugging_face_model_scores_as_stock_hflm_on_every_request_type(kind, tmp_path, offline):
    """The adapter with full attention through this project's kernels against lm_eval's own HFLM on the same
    folder: word-boundary and inside-word splits, empty context, rolling windows, a tokenizer that adds BOS
    and one that does not, contexts past max_position_embeddings, batched generation."""
    from lm_eval.models.huggingface import HFLM

    folder = tiny_hf_model(tmp_path / kind, kind)
    stock = HFLM(pretrained=str(folder), device="cpu", batch_size=3, dtype="float32")
    ours = EfficientAttentionLM(pretrained=str(folder), device="cpu", batch_size=3, dtype="float32",
                                attn_pattern="full")
    assert type(ours.model.model.layers[0].self_attn).__name__.endswith("Attention")
    assert ours.model.config._attn_implementation == "efficient_attention"  # the variant path, not sdpa
    long = SENTENCES * 3  # past the model's 48 positions
    ll = [request("loglikelihood", "the cat sat on the", " mat."), request("loglikelihood", "the cat sat on the m", "at. the dog"),
          request("loglikelihood", "", "the dog ran"), request("loglikelihood", "a bird flew over the ", "tree."),
          request("loglikelihood", long, " the end")]
    roll = [request("loglikelihood_rolling", long), request("loglikelihood_rolling", "the cat sat.")]
    gen = [request("generate_until", "the cat", {"until": ["."], "max_gen_toks": 8}),
           request("generate_until", long, {"until": ["\n"], "max_gen_toks": 8}),
           request("generate_until", "a", {"until": ["."], "max_gen_toks": 8})]
    for reference, got in ((stock.loglikelihood(ll, disable_tqdm=True), ours.loglikelihood(ll, disable_tqdm=True)),
                           (stock.loglikelihood_rolling(roll, disable_tqdm=True),
                            ours.loglikelihood_rolling(roll, disable_tqdm=True))):
        for a, b in zip(reference, got):
            a, b = (a, b) if isinstance(a, float) else (a[0], b[0])
            assert b == pytest.approx(a, abs=1e-4)
    assert ours.generate_until(gen, disable_tqdm=True) == stock.generate_until(gen, disable_tqdm=True)
    assert ours.prefix_token_id == stock.prefix_token_id == (0 if kind == "llama" else 1)
    assert ours.max_length == stock.max_length == 48


@pytest.mark.e2e
def test_simple_evaluate_on_local_tasks(model, tok, run, tmp_path, offline):
    from lm_eval.tasks import TaskManager

    write_tasks(tmp_path)
    # logits_cache=False: lm_eval 0.4.13's cache shares one forward among requests whose context + continuation
    # is the same text, and scores the shorter continuation at the longer one's first positions (items 0 and 3
    # here: "the cat sat on the| mat." and "the cat sat| on the mat."); docs/evaluation.md
    lm = adapter(run, batch_size=4, logits_cache=False)
    results = lm_eval.simple_evaluate(model=lm, tasks=["tiny_mc", "tiny_ppl", "tiny_gen"],
                                      task_manager=TaskManager(include_path=str(tmp_path)),
                                      bootstrap_iters=0, log_samples=True)
    res = results["results"]
    assert results["config"]["model"] == str(run)  # results name the model by its folder
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
