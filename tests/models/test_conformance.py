"""The conformance kit: every case of the mixer registry (each registered mixer, its check_variants and each pattern
alias: attention/registry.py example_cases) runs through the same checks, and every test id carries the case's
name, so `python -m pytest -k NAME tests/models/test_conformance.py tests/models/test_gpu_sim.py` runs the whole kit
for one mixer. No check names a mixer: each takes its cases from the registry and what a mixer declares
(attn_backend among its settings, forms, takes_documents, supports_cache, translation_invariant). A mixer added as
one file in attention/ is in every check with no edit here (tests/models/test_kit_new_mixers.py shows it).

    forms        the model on every form it has (attention kernels, the recurrence core's chunked and one-step
                 forms) equals its reference (the dense kernel, the core's parallel form), logits and every
                 gradient, with packed documents
    documents    an earlier document changes nothing after an end-of-text token (nor does its gradient reach
                 it); a sequence without one is unchanged by document_mask; under rules of relative positions a
                 document packed has the logits it has alone. A mixer that does not take documents is refused
    generation   cached generation equals re-running the context, over contexts longer than any chunk or tile
                 the mixers use, across document boundaries in the prompt and in the generated tokens
    memory       the activation estimate (runtime/memory_plan.py) within 10% of what autograd keeps, per block
                 and in all, in float32 and under bf16 autocast
    export       the run exported as a Hugging Face model gives the run's logits through transformers
and in tests/models/test_gpu_sim.py, the CUDA path simulated on the CPU: compiled training against the dense
reference, with documents, bf16 autocast and weights, the GPU kernels' stand-ins, cached generation in bf16."""

from __future__ import annotations

import pytest
import torch
import transformers

from attention.registry import MIXERS, example_cases, pattern_names, setting_name
from config import ModelConfig
from helpers import cached_logits, save_run
from model import GPT

WINDOW = 32  # the cases' windows and blocks (example_settings)
EOT = 5
CASES = example_cases(WINDOW)
NAMES = sorted(CASES)
# longer than any chunk or tile the cases use: the recurrences' chunks (64 by default), the kernels' query chunks
CONTEXT = 200
MEMORY_TOLERANCE = 0.10


def mixers_of(case: str) -> list:
    return [MIXERS[name] for name in dict.fromkeys(pattern_names(CASES[case]["attn_pattern"]))]


def takes_documents(case: str) -> bool:
    return all(mixer.takes_documents for mixer in mixers_of(case))


def config_for(case: str, **extra) -> ModelConfig:
    # a case may need its own depth (mswa's schedule)
    settings = {"arch": "llama", "n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 256, "vocab_size": 61,
                "bias": False, "eot_id": EOT, **CASES[case], **extra}
    return ModelConfig(**settings)


def model_for(case: str, dtype=torch.float64, **extra) -> GPT:
    torch.manual_seed(0)
    return GPT(config_for(case, **extra)).to(dtype).eval()


def packed_tokens(n=45, boundaries=(0, 13, 14, 30), batch=2, seed=0):
    """Token rows with end-of-text tokens at `boundaries` in row 0 (a document of length 1 at 13), none
    elsewhere in row 0 and at 20 in row 1 (when n > 20)."""
    idx = torch.randint(6, 61, (batch, n), generator=torch.Generator().manual_seed(seed))
    for b in boundaries:
        idx[0, b] = EOT
    if batch > 1 and n > 20:
        idx[1, 20] = EOT
    return idx


def logits(model, idx, seed=0):
    torch.manual_seed(seed)  # sa draws its permutations: the same for every call compared
    return model(idx)[0]


# ---- forms ------------------------------------------------------------------------------------------------------


def forms_of(case: str) -> list[tuple[str, str]]:
    """(attention backend, recurrence form) pairs the case runs in, the reference first: the dense kernel and the
    core's parallel form; then chunked kernels with the one-step form, and auto (what training picks) with the
    chunked form. Only what the case's mixers read varies."""
    backends = any("attn_backend" in {setting_name(s) for s in mixer.settings} for mixer in mixers_of(case))
    recurrent = any(getattr(mixer, "forms", ()) for mixer in mixers_of(case))
    pairs = [("dense" if backends else "auto", "parallel" if recurrent else None),
             ("chunked" if backends else "auto", "step" if recurrent else None),
             ("auto", "chunked" if recurrent else None)]
    return list(dict.fromkeys(pairs))


def in_form(case: str, backend: str, form: str | None) -> GPT:
    model = model_for(case, attn_backend=backend, document_mask=takes_documents(case)).train()
    for block in model.blocks:
        if form is not None and form in getattr(block.mixer, "forms", ()):
            block.mixer.form = form
    return model


@pytest.mark.parametrize("case", NAMES)
def test_forms_agree_with_the_reference_forward_and_backward(case):
    pairs = forms_of(case)
    assert len(pairs) >= 2, (f"{case} has one form only: read attn_backend (attention) or declare the recurrence "
                             "core's forms (attention/registry.py: RecurrentMixer.forms), so its fast path has a "
                             "reference to be held to")
    # an odd length, documents of length 1, end-of-text tokens at the first and last positions
    idx = packed_tokens(n=CONTEXT - 3, boundaries=(0, 13, 14, 30, 101, CONTEXT - 4))
    results = []
    for backend, form in pairs:
        model = in_form(case, backend, form)
        out = logits(model, idx, seed=4)
        out.square().mean().backward()
        results.append((out.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}))
    (reference, reference_grads), others = results[0], results[1:]
    for (backend, form), (out, grads) in zip(pairs[1:], others):
        what = f"{case} on {backend} kernels" + (f", recurrence {form}" if form else "")
        torch.testing.assert_close(out, reference, rtol=1e-9, atol=1e-9, msg=what)
        assert grads.keys() == reference_grads.keys(), what
        for name in grads:
            torch.testing.assert_close(grads[name], reference_grads[name], rtol=1e-8, atol=1e-9, msg=f"{what}: {name}")


# ---- documents --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", NAMES)
def test_a_document_is_untouched_by_what_precedes_it(case):
    """Changing the tokens of one document changes no logit of the next, and the gradient of the later document's
    loss with respect to the earlier document's embeddings is zero. A case whose mixers do not all take documents
    is refused with document_mask."""
    if not takes_documents(case):
        with pytest.raises(ValueError, match="does not declare takes_documents"):
            model_for(case, document_mask=True)
        return
    model = model_for(case, document_mask=True)
    idx = packed_tokens()
    changed = idx.clone()
    changed[0, 15:30] = torch.randint(6, 61, (15,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = logits(model, idx), logits(model, changed)
    assert (a[0, 30:] - b[0, 30:]).abs().max() < 1e-12
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


@pytest.mark.parametrize("case", [case for case in NAMES if takes_documents(case)])
def test_without_an_end_of_text_token_document_mask_changes_nothing(case):
    idx = packed_tokens(boundaries=(), batch=1)
    with torch.no_grad():
        on = logits(model_for(case, document_mask=True), idx)
        off = logits(model_for(case, document_mask=False), idx)
    assert torch.equal(on, off)


def relative(case: str) -> bool:
    """Whether every layer's outputs depend on relative positions alone (Mixer.translation_invariant: declared by
    recurrent mixers, derived from the rules for attention under edge rules)."""
    return all(block.mixer.translation_invariant for block in GPT(config_for(case)).blocks)


@pytest.mark.parametrize("case", [case for case in NAMES if takes_documents(case) and relative(case)])
def test_a_document_alone_has_the_logits_it_has_packed(case):
    """Under rules of relative positions (windows, recurrences; with RoPE) a document at positions 14..29 of a
    packed window has the logits it has at 0..15 alone."""
    model = model_for(case, document_mask=True)
    idx = packed_tokens(batch=1)
    with torch.no_grad():
        packed = logits(model, idx)[0, 14:30]
        alone = logits(model, idx[:, 14:30])[0]
    torch.testing.assert_close(packed, alone, rtol=1e-9, atol=1e-9)


# ---- generation -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", NAMES)
def test_cached_generation_equals_rerunning_the_context(case):
    """Over a context longer than any chunk or tile: the cached steps' logits equal the single pass's, with
    end-of-text tokens in the prompt and in the steps (with document_mask where the case takes documents), and
    greedy generation with the caches gives the tokens of re-running the context."""
    model = model_for(case, document_mask=takes_documents(case))
    tokens = packed_tokens(n=CONTEXT, boundaries=(0, 9, 70, 71, 150, CONTEXT - 6), seed=2)
    prompt = CONTEXT - 16
    with torch.no_grad():
        full = logits(model, tokens)
        cached = cached_logits(model, tokens, prompt) if all(block.mixer.supports_cache for block in model.blocks) \
            else None
    if cached is not None:
        torch.testing.assert_close(cached, full, rtol=1e-9, atol=1e-9)
    # generate's own plumbing (the logits' equality is above): three tokens take the prompt's pass and two steps
    torch.manual_seed(0)
    with_cache = model.generate(tokens[:, :prompt], 3, temperature=0, use_cache=True)
    torch.manual_seed(0)
    assert torch.equal(with_cache, model.generate(tokens[:, :prompt], 3, temperature=0, use_cache=False))


# ---- memory -----------------------------------------------------------------------------------------------------


def saved_for_backward(model: GPT, idx, autocast: bool) -> tuple[list[int], int]:
    """Bytes autograd keeps after one forward: every saved tensor's storage counted once (many saved tensors are
    views of one storage), parameters and autocast's copies of them excluded (the estimate counts those as
    weights). Returns the bytes first saved inside each block, and the rest (embedding, final norm, head, loss)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape[::-1]) for p in model.parameters()}
    owner, seen = ["outside"], {}

    def leave(module, args, output):  # (a hook that returns something replaces the block's output)
        owner.pop()

    hooks = []
    for i, block in enumerate(model.blocks):
        hooks.append(block.register_forward_pre_hook(lambda module, args, i=i: owner.append(i)))
        hooks.append(block.register_forward_hook(leave))

    def pack(t):
        storage = t.untyped_storage()
        weight_copy = t.dtype == torch.bfloat16 and tuple(t.shape) in weight_shapes and storage.nbytes() == 2 * t.numel()
        if storage.data_ptr() not in params and not weight_copy:
            seen.setdefault(storage.data_ptr(), (owner[-1], storage.nbytes()))
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(idx[:, :-1], idx[:, 1:])
    finally:
        for hook in hooks:
            hook.remove()
    per_block = [sum(size for where, size in seen.values() if where == i) for i in range(len(model.blocks))]
    return per_block, sum(size for where, size in seen.values() if where == "outside")


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16_autocast"])
@pytest.mark.parametrize("case", NAMES)
def test_the_memory_estimate_is_within_10_percent_of_what_autograd_keeps(case, autocast):
    from runtime.memory_plan import Kernels, block_activations, head_saved

    model = model_for(case, dtype=torch.float32, n_embd=96, vocab_size=320, dropout=0.0).train()
    m, batch = model.config, 2
    kernels = Kernels("cpu", 2 if autocast else 4)  # the CPU's kernels; activations bf16 under autocast
    idx = torch.randint(0, m.vocab_size, (batch, m.block_size + 1), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    per_block, outside = saved_for_backward(model, idx, autocast)
    layers = [block_activations(block, m, kernels, batch, m.block_size) for block in model.blocks]
    head = sum(head_saved(m, kernels, batch, m.block_size, loss_chunk=0).values())

    def close(estimated, measured, what):
        assert abs(estimated - measured) <= MEMORY_TOLERANCE * measured, \
            f"{case} {what}: estimated {estimated:,} bytes, measured {measured:,} ({estimated / measured - 1:+.1%})"
    for i, (layer, measured) in enumerate(zip(layers, per_block)):
        close(layer.total, measured, f"block {i} ({layer.mixer})")
    close(sum(layer.total for layer in layers) + head, sum(per_block) + outside, "in all")


@pytest.mark.parametrize("case", NAMES)
def test_full_checkpointing_keeps_only_the_block_inputs(case):
    """Through the forward each checkpointed block keeps its input (and positions), saved by the checkpoint; its
    activations (what the estimate above counts) are recomputed in backward, one block at a time."""
    from runtime.memory_plan import Kernels, block_activations, head_saved
    from runtime.parallelize import apply_activation_checkpointing

    model = model_for(case, dtype=torch.float32, n_embd=96, vocab_size=320, dropout=0.0).train()
    m, batch, kernels = model.config, 2, Kernels("cpu", 4)
    apply_activation_checkpointing(model, "full")
    idx = torch.randint(0, m.vocab_size, (batch, m.block_size + 1), generator=torch.Generator().manual_seed(0))
    per_block, outside = saved_for_backward(model, idx, autocast=False)
    layers = [block_activations(block, m, kernels, batch, m.block_size) for block in model.blocks]
    for i, (layer, measured) in enumerate(zip(layers, per_block)):
        assert abs(layer.kept("full") - measured) <= MEMORY_TOLERANCE * measured, (case, i, layer.kept("full"), measured)
    head = sum(head_saved(m, kernels, batch, m.block_size, loss_chunk=0).values())
    total, estimated = sum(per_block) + outside, sum(layer.kept("full") for layer in layers) + head
    assert abs(estimated - total) <= MEMORY_TOLERANCE * total, (case, estimated, total)


# ---- export -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", NAMES)
def test_an_export_gives_the_run_s_logits_through_transformers(case, tmp_path, offline, monkeypatch):
    import export

    monkeypatch.setattr(export, "git_hash", lambda: "conformance")  # the record's git hash, without a git process
    model = model_for(case, dtype=torch.float32, vocab_size=320, block_size=64)
    folder = export.export_run(export.ExportConfig(out_dir=str(save_run(model, tmp_path / "run")),
                                                   to=str(tmp_path / "hf")))
    project = (folder / export.MODELING_FILE).exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=project).eval()
    ids = torch.randint(0, 257, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = logits(model, ids), None
        torch.manual_seed(0)  # sa draws its permutations from torch's generator, as logits() seeds it
        theirs = hf(ids).logits
    assert (ours - theirs).abs().max() <= 1e-5, (ours - theirs).abs().max()


def test_the_kit_covers_every_registered_mixer_and_alias():
    from attention.registry import PATTERN_ALIASES

    assert set(MIXERS) | set(PATTERN_ALIASES) <= set(CASES)
    assert {name for case in CASES.values() for name in pattern_names(case["attn_pattern"])} == set(MIXERS)
