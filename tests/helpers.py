"""What several test modules share (test modules never import each other): the attention kernels' rules, inputs
and checks, and the lm-evaluation-harness's local tasks with a run to score. Imported by name, as conftest is
(`from helpers import qkv`): pytest puts tests/, the folder of conftest.py, on the import path."""

import json
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from attention.bridge import BoundaryWindows
from attention.edges import AnyOf, Causal, EdgeRule, FixedBlock, GlobalKeys, SlidingWindow, head_values
from config import ModelConfig
from conftest import generator
from model import GPT

# ---- sampled parametrisations ------------------------------------------------------------------------------


def covering(*axes) -> list[tuple]:
    """A sample of the product of AXES in which every value of every axis appears at least once, as many cases as
    the longest axis has values (case i takes value i mod len of each axis): for a parametrisation whose axes each
    exercise their own code path and whose full product would cost minutes, every path runs, the product does
    not. covering([1, 2, 3], "ab") == [(1, "a"), (2, "b"), (3, "a")]."""
    axes = [list(axis) for axis in axes]
    return [tuple(axis[i % len(axis)] for axis in axes) for i in range(max(len(axis) for axis in axes))]


# ---- the attention kernels: rules of every kind, inputs, the dense reference's checks -----------------------


@dataclass(frozen=True)
class PerHeadRule(EdgeRule):
    """A per-head rule (head h sees the windows[h] most recent keys), as multi-scale variants need."""

    windows: tuple = (3, 8, 17, 40)
    per_head = True

    @property
    def lookback(self):
        return max(self.windows) - 1

    def allowed(self, q, k, h=None):
        return (k <= q) & (q - k < head_values(self.windows, h))


# paper 004's union forms: fixed blocks plus one causal window across each boundary
BRIDGED = [AnyOf((FixedBlock(16), BoundaryWindows("bridge", 16, 16, 257))),
           AnyOf((FixedBlock(20), BoundaryWindows("pbb", 20, 12, 257))),
           AnyOf((FixedBlock(16), BoundaryWindows("se_bridge", 16, 8, 257)))]
# a window plus global keys: unbounded lookback whose key_ranges name its few far keys (sinks, global tokens)
GLOBAL = [AnyOf((SlidingWindow(16), GlobalKeys(3))), AnyOf((FixedBlock(20), GlobalKeys(1)))]
RULES = [Causal(), SlidingWindow(16), SlidingWindow(33), FixedBlock(16), FixedBlock(20), PerHeadRule(), *BRIDGED,
         *GLOBAL]
CUDA_HEAD_DIM = 16  # the GPU checks' head dimension: the smallest CUDA FlexAttention takes


def qkv(n, heads=4, dim=8, seed=0, dtype=torch.float64, device=None):
    """q, k, v of shape (2, heads, n, dim), seeded, requiring gradients."""
    g = generator(seed, device)
    return [torch.randn(2, heads, n, dim, generator=g, dtype=dtype, device=device).requires_grad_() for _ in range(3)]


@dataclass(frozen=True)
class Dilated(EdgeRule):
    """A dilated window per head (dilations 1, 2, 3, 4: odd classes at odd lengths), as allowed() alone: its heads
    run in residue-class layouts (attention/layouts.py)."""

    window: int = 6
    dilations: tuple = (1, 2, 3, 4)
    per_head = True

    def allowed(self, q, k, h=None):
        d = head_values(self.dilations, h)
        return (k <= q) & ((q - k) % d == 0) & (q - k < d * self.window)


def packed_documents(batch, n, lengths=(1, 40), seed=0, eot_first=True, eot_last=False, device=None):
    """docs (batch, n) as GPT.forward finds them (attention/documents.py) for token rows of documents with random
    lengths in [lengths[0], lengths[1]]: row 0 has an end-of-text token at position 0 (eot_first) and one document
    of length 1; eot_last puts one at the last position of row 0; the last row (when batch > 1) has no end-of-text
    token at all (one document)."""
    from attention.documents import document_starts
    g = torch.Generator().manual_seed(seed)
    eot = torch.zeros(batch, n, dtype=torch.bool, device="cpu")  # on the CPU even under a default device
    for b in range(batch if batch == 1 else batch - 1):
        i = 0 if b == 0 and eot_first else int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
        while i < n:
            eot[b, i] = True
            i += int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
    if n > 3:
        eot[0, 2] = eot[0, 3] = True  # a document of length 1 (position 2)
    if eot_last:
        eot[0, n - 1] = True
    idx = torch.where(eot, 7, 1)
    return document_starts(idx, 7, torch.arange(n, device="cpu")).to(device or "cpu")


def assert_losses_close(a, b, tolerance, what):
    """Two runs' metrics ({step: loss}) at the same steps, each within tolerance."""
    assert a.keys() == b.keys(), (what, sorted(a), sorted(b))
    worst = max(abs(a[s] - b[s]) for s in a)
    assert worst <= tolerance, f"{what}: losses differ by {worst:.3g}"


def weighted_fwd_bwd(fn, tensors, backward=True):
    """fn(*tensors) and the gradients of its output weighted by a ramp over the last axis (None without backward)."""
    if not backward:
        return fn(*(t.detach() for t in tensors)), None
    out = fn(*tensors)
    weights = torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype, device=out.device)
    return out, torch.autograd.grad((out * weights).sum(), tensors)


def fwd_bwd(fn, tensors, backward=True):
    """fn(*tensors) and its gradients for a fixed random output gradient (None without backward)."""
    if not backward:
        return fn(*(t.detach() for t in tensors)), None
    y = fn(*tensors)
    grad_out = torch.randn(y.shape, generator=generator(1, y.device), dtype=y.dtype, device=y.device)
    grads = torch.autograd.grad(y, tensors, grad_out)
    return y, grads


def flex_has_backward(device) -> bool:
    """torch 2.13's FlexAttention has a backward on CUDA only: gpu tests check flex's forward alone on the CPU,
    unless the CPU stands in for CUDA (EFFICIENT_ATTENTION_SIMULATE_CUDA=1), where it runs compiled with
    aot_eager."""
    from attention import simulate_cuda

    return simulate_cuda.gpu_path(device)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces, forward and backward."""

    def __init__(self):
        super().__init__()
        self.numel, self.shape = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.shape = t.numel(), tuple(t.shape)
        return out


def assert_close_at_scale(ours, reference, dtype):
    """Within 0.2% (float32 inputs: TF32-free IEEE products) or 2% (bfloat16 inputs and probabilities) of the
    reference's largest magnitude: bf16 rounds each product's inputs, and sigmoid attention's unnormalised sums
    grow with the window."""
    error = float((ours.float() - reference.float()).abs().max())
    scale = float(reference.float().abs().max())
    assert error <= (2e-3 if dtype == torch.float32 else 2e-2) * scale, (error, scale)


def tiny(arch="gpt2", pattern="swa", n_layer=2, **kw):
    """A small GPT in eval mode (2 heads, 32 wide, 128 positions, 61 tokens) under an attention pattern."""
    cfg = ModelConfig(arch=arch, n_layer=n_layer, n_head=2, n_embd=32, block_size=128, vocab_size=61,
                      bias=arch == "gpt2", attn_pattern=pattern, swa_window=8, block_len=8, **kw)
    torch.manual_seed(0)
    return GPT(cfg).eval()


# ---- lm-evaluation-harness: local tasks (no download) and a run folder to score ---------------------------

SENTENCES = "the cat sat on the mat. the dog ran to the park. a bird flew over the tree. "
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


def write_tasks(folder):
    """Three lm_eval tasks from local JSON lines (tiny_mc, tiny_ppl, tiny_gen), their YAML files in folder."""
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


def save_run(model, folder, step=7):
    """A run folder holding the model as its best checkpoint (byte tokenizer), as train.py writes one."""
    from config import Config
    from data.tokenizer import get_tokenizer
    from runtime.checkpoint import save_checkpoint

    folder.mkdir(parents=True, exist_ok=True)
    cfg = Config()
    cfg.model = model.config
    save_checkpoint({"model": model.state_dict(), "config": cfg.to_dict(), "step": step, "tokenizer": "byte",
                     "tokenizer_identity": get_tokenizer("byte").identity()}, folder / "ckpt_best.pt")
    return folder


def cached_logits(model, idx, prompt: int):
    """The logits of idx (B, T) as cached generation computes them: the first `prompt` tokens in one call, then one
    token per call through the same caches (to compare with the model's single pass)."""
    caches = model.init_caches(idx.shape[0], idx.shape[1])
    logits = [model(idx[:, :prompt], caches=caches)[0]]
    for t in range(prompt, idx.shape[1]):
        logits.append(model(idx[:, t:t + 1], caches=caches, start_pos=t)[0])
    return torch.cat(logits, dim=1)
