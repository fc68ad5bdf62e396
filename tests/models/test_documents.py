"""Packed documents (document_mask) at the model level, for every case of the registry: no information crosses an
end-of-text token, the rule's edges AND same document equal the dense reference, a sequence without one is
unchanged, a document's logits do not depend on what precedes it (rules of relative positions, RoPE), and cached
generation equals the uncached forward."""

from __future__ import annotations

import pytest
import torch

from attention.registry import MIXERS, Mixer, example_cases, pattern_names
from config import ModelConfig
from helpers import cached_logits
from model import GPT

WINDOW = 32
EOT = 5
CASES = example_cases(WINDOW)
# rules of relative positions only (and the recurrent mixers and their hybrids): a document run alone equals the
# same document inside a packed window, under RoPE
RELATIVE = ("full", "swa", "mswa", "mswa_h", "mswa_l", "swat", "mlstm", "gated_deltanet", "linear", "swax", "swax_gdn")


def model_for(case: str, document_mask=True, backend="auto", arch="llama", n_layer=2, **extra):
    settings = {"n_layer": n_layer, **CASES[case], **extra}  # a case may need its own depth (mswa's schedule)
    config = ModelConfig(arch=arch, n_head=4, n_embd=32, block_size=128, vocab_size=61,
                         bias=False, attn_backend=backend, document_mask=document_mask, eot_id=EOT, **settings)
    torch.manual_seed(0)
    model = GPT(config).double().eval()
    return model


def packed_tokens(n=45, boundaries=(0, 13, 14, 30), batch=2, seed=0):
    """Token rows with end-of-text tokens at `boundaries` in row 0 (a document of length 1 at 13), none
    elsewhere in row 0 and at 20 in row 1."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(6, 61, (batch, n), generator=g)
    for b in boundaries:
        idx[0, b] = EOT
    if batch > 1:
        idx[1, 20] = EOT
    return idx


def logits(model, idx, seed=0):
    torch.manual_seed(seed)  # sa draws its permutations: the same for every call compared
    return model(idx)[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_document_is_untouched_by_what_precedes_it(case):
    """Changing the tokens of one document changes no logit of the next, and the gradient of the later document's
    loss with respect to the earlier document's embeddings is zero."""
    model = model_for(case)
    idx = packed_tokens()
    changed = idx.clone()
    changed[0, 15:30] = torch.randint(6, 61, (15,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = logits(model, idx), logits(model, changed)
    assert torch.equal(a[0, 30:], b[0, 30:]) or (a[0, 30:] - b[0, 30:]).abs().max() < 1e-12
    assert (a[0, 15:30] - b[0, 15:30]).abs().max() > 1e-6  # the document itself did change

    embeddings = []
    hook = model.wte.register_forward_hook(lambda module, args, out: embeddings.append(out) or out.retain_grad())
    try:
        model.train()  # sa draws; the gradient must still stop at the boundary
        logits(model, idx, seed=3)[0, 30:].square().sum().backward()
    finally:
        hook.remove()
    grad = embeddings[0].grad
    assert grad[0, :30].abs().max() == 0
    assert grad[0, 30:].abs().max() > 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_without_an_end_of_text_token_nothing_changes(case):
    idx = packed_tokens(boundaries=(), batch=1)
    with torch.no_grad():
        on = logits(model_for(case, document_mask=True), idx)
        off = logits(model_for(case, document_mask=False), idx)
    assert torch.equal(on, off)


def attention_cases():
    from attention.layer import MaskedAttention
    return sorted(case for case, settings in CASES.items()
                  if all(issubclass(MIXERS[name], MaskedAttention) for name in pattern_names(settings["attn_pattern"])))


@pytest.mark.parametrize("case", attention_cases())
def test_every_kernel_equals_the_dense_reference_over_rule_and_document(case):
    """Forward and backward of the model on the CPU's kernels (auto) equal the dense backend's with documents, at
    an odd length, with documents of length 1 and end-of-text tokens at the first and last positions."""
    idx = packed_tokens(n=47, boundaries=(0, 13, 14, 30, 46))
    results = []
    for backend in ("auto", "dense"):
        model = model_for(case, backend=backend).train()
        out = logits(model, idx, seed=4)
        out.square().mean().backward()
        results.append((out.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}))
    (auto, auto_grads), (dense, dense_grads) = results
    torch.testing.assert_close(auto, dense, rtol=1e-9, atol=1e-9)
    assert auto_grads.keys() == dense_grads.keys()
    for name in auto_grads:
        torch.testing.assert_close(auto_grads[name], dense_grads[name], rtol=1e-8, atol=1e-9, msg=name)


@pytest.mark.parametrize("case", [case for case in RELATIVE if case in CASES])
def test_a_document_alone_has_the_logits_it_has_packed(case):
    """With RoPE, a document at positions 14..29 of a packed window has the logits it has at 0..15 alone."""
    model = model_for(case)
    idx = packed_tokens(batch=1)
    with torch.no_grad():
        packed = logits(model, idx)[0, 14:30]
        alone = logits(model, idx[:, 14:30])[0]
    torch.testing.assert_close(packed, alone, rtol=1e-9, atol=1e-9)


def caches(name: str) -> bool:
    """Whether a registered mixer generates from caches (Mixer.supports_cache, read off the class)."""
    declared = MIXERS[name].supports_cache
    return declared if isinstance(declared, bool) else MIXERS[name].init_cache is not Mixer.init_cache


@pytest.mark.parametrize("case", sorted(case for case, settings in CASES.items()
                                        if all(caches(name) for name in pattern_names(settings["attn_pattern"]))))
def test_cached_generation_equals_the_uncached_forward_across_documents(case):
    """Greedy generation with the caches gives the tokens of re-running the context, when the prompt holds
    end-of-text tokens and when one is generated (forced by making it the likeliest token after a few steps)."""
    model = model_for(case, n_layer=2)
    prompt = packed_tokens(n=21, boundaries=(0, 7, 8, 15), batch=2)
    cached = model.generate(prompt, 12, temperature=0, use_cache=True)
    uncached = model.generate(prompt, 12, temperature=0, use_cache=False)
    assert torch.equal(cached, uncached)
    # the cached steps' logits (not only the argmax) equal the uncached forward's, over a boundary inside the steps
    tokens = packed_tokens(n=30, boundaries=(0, 9, 20, 24), batch=2)
    with torch.no_grad():
        full = logits(model, tokens)
        cached = cached_logits(model, tokens, 6)
    torch.testing.assert_close(cached, full, rtol=1e-9, atol=1e-9)


def test_document_mask_needs_the_end_of_text_token():
    with pytest.raises(ValueError, match="eot_id"):
        GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=61, document_mask=True, eot_id=-1))
