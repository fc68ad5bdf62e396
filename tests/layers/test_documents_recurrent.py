"""Packed documents in the recurrent mixers (mLSTM, Gated DeltaNet and its short convolutions, Taylor linear
attention): with docs, every form (references, chunked, step by step) equals each document run alone from a
zero state, forward and backward; docs without a boundary change no bit; cached generation equals one pass;
no n x n tensor; the GPU kernels' closed gates (their CPU stand-ins) stay close to the exact forms."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from attention import simulate_cuda
from attention.documents import begins_document
from attention.ops.gated_deltanet.chunk import chunked_gated_delta_rule
from attention.ops.gated_deltanet.conv import causal_conv
from attention.ops.gated_deltanet.naive import recurrent_gated_delta_rule
from attention.ops.linear.chunk import chunked_linear_attention
from attention.ops.linear.naive import quadratic_linear_attention
from attention.ops.linear.recurrent import recurrent_linear_attention
from attention.ops.mlstm.chunkwise import chunkwise_mlstm
from attention.ops.mlstm.naive import quadratic_mlstm
from attention.ops.mlstm.op import mlstm_sequence
from attention.ops.mlstm.recurrent import recurrent_mlstm
from config import ModelConfig
from conftest import generator
from helpers import LargestTensor, cached_logits, packed_documents
from model import GPT

ROWS, HEADS = 3, 2
MIXERS = ("mlstm", "gated_deltanet", "linear")


def document_starts_of(n, continues=False, eot_last=False, seed=0):
    """starts (3, n) of packed_documents (documents of 1 to 12 tokens; row 0 with one of length 1 and one at its
    first token, the last row with none). continues: the rows without an end-of-text token at 0 continue the
    document before them (a cached call), so only row 0 drops the state it starts from."""
    docs = packed_documents(ROWS, n, lengths=(1, 12), seed=seed, eot_last=eot_last)
    starts = begins_document(docs, torch.arange(n))
    if continues:
        starts[1:, 0] = False
    return starts


def tensors_of(mixer, n, seed=0, dtype=torch.float64):
    """The inputs of a mixer's forms (3 rows, 2 heads, odd widths) and a state to start from, requiring grads."""
    g = generator(seed)
    randn = lambda *shape: torch.randn(ROWS, HEADS, *shape, generator=g, dtype=dtype)  # noqa: E731
    if mixer == "mlstm":  # gates near the layer's initialisation (input -10, forget 3..6): the stabiliser's regime
        tensors = [randn(n, 4), randn(n, 4), randn(n, 5), randn(n) * 3 - 10, randn(n) * 2 + 4]
        state = [randn(4, 5), randn(4), randn(1)]
    elif mixer == "gated_deltanet":
        q, k = F.normalize(randn(n, 4), dim=-1) / 2, F.normalize(randn(n, 4), dim=-1)
        tensors = [q, k, randn(n, 5), -F.softplus(randn(n)), torch.sigmoid(randn(n))]
        state = [randn(4, 5)]
    else:
        tensors = [randn(n, 4), randn(n, 4), randn(n, 5)]
        z = randn(21) * 0.1  # F = 1 + 4 + 16 features; a large constant feature keeps every read positive
        z[..., 0] += 10
        state = [randn(21, 5) * 0.1, z]
    return [t.requires_grad_() for t in tensors], [t.requires_grad_() for t in state]


def state_arg(mixer, state):
    """The state as the forms take it (a tuple; Gated DeltaNet's is one tensor), or None."""
    if state is None:
        return None
    return state[0] if mixer == "gated_deltanet" else tuple(state)


def run_form(mixer, form, tensors, state, starts, chunk):
    """A form on whole rows: (output, final state as a list or None)."""
    state = state_arg(mixer, state)
    if mixer == "mlstm":
        if form == "reference":
            return quadratic_mlstm(*tensors, state, starts=starts), None
        if form == "recurrent":
            y, final = recurrent_mlstm(*tensors, state, starts=starts)
        else:
            y, final = chunkwise_mlstm(*tensors, state, chunk, starts=starts)
    elif mixer == "gated_deltanet":
        if form in ("reference", "recurrent"):
            y, final = recurrent_gated_delta_rule(*tensors, state, starts=starts)
        else:
            y, final = chunked_gated_delta_rule(*tensors, state, chunk, starts=starts)
        final = [final]
    else:
        if form == "reference":
            return quadratic_linear_attention(*tensors, starts=starts), None
        if form == "recurrent":
            y, final = recurrent_linear_attention(*tensors, state, starts=starts)
        else:
            y, final = chunked_linear_attention(*tensors, state, chunk, starts=starts)
    return y, list(final)


def by_document(mixer, tensors, state, starts):
    """The definition: each row cut at its documents' starts, every piece run alone from a zero state by the
    mixer's reference form (a row's first piece from `state` when the row continues it), outputs concatenated;
    the final states from the recurrent form over the same pieces."""
    outputs, finals = [], []
    for b in range(starts.shape[0]):
        cuts = sorted({0, starts.shape[1], *starts[b].nonzero().flatten().tolist()})
        row_state = None if state is None or starts[b, 0] else [t[b:b + 1] for t in state]
        pieces = []
        for begin, end in zip(cuts[:-1], cuts[1:]):
            piece = [t[b:b + 1, :, begin:end] for t in tensors]
            first = row_state if begin == 0 else None
            if mixer == "linear" and first is not None:  # the quadratic reference starts from zero only
                pieces.append(recurrent_linear_attention(*piece, state_arg(mixer, first))[0])
            else:
                pieces.append(run_form(mixer, "reference", piece, first, None, 1)[0])
            final = run_form(mixer, "recurrent", piece, first, None, 1)[1]
        outputs.append(torch.cat(pieces, dim=2))
        finals.append(final)
    return torch.cat(outputs), [torch.cat(parts) for parts in zip(*finals)]


def probe_grads(outputs, tensors):
    """Gradients of the outputs (each weighted by a fixed random tensor) with respect to tensors."""
    g = generator(1)
    weights = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in outputs]
    return torch.autograd.grad(outputs, tensors, weights, allow_unused=True)


FORMS = [(mixer, form) for mixer in MIXERS for form in ("reference", "chunked", "recurrent")]


# continues: from a state (linear attention's quadratic reference takes none: it always starts from zero)
@pytest.mark.parametrize("mixer, form, continues", [(mixer, form, continues) for mixer, form in FORMS
                                                     for continues in (False, True)
                                                     if not (continues and (mixer, form) == ("linear", "reference"))])
@pytest.mark.parametrize("n, chunk", [(37, 8), (29, 16), (6, 4), (1, 4)])
def test_forms_equal_each_document_alone_forward_and_backward(mixer, form, n, chunk, continues):
    # float64, torch's default tolerances: exact. Odd lengths, documents of length 1, an end-of-text token at
    # the first position (row 0), a row with none; continues: the other rows carry the state they start from
    tensors, state = tensors_of(mixer, n)
    state = state if continues else None
    starts = document_starts_of(n, continues=continues)
    y, final = run_form(mixer, form, tensors, state, starts, chunk)
    y_ref, final_ref = by_document(mixer, tensors, state, starts)
    torch.testing.assert_close(y, y_ref)
    outputs, outputs_ref = [y], [y_ref]
    if final is not None:
        for a, b in zip(final, final_ref):
            torch.testing.assert_close(a, b)
        outputs, outputs_ref = [y, *final], [y_ref, *final_ref]
    leaves = tensors + (state or [])
    for a, b in zip(probe_grads(outputs, leaves), probe_grads(outputs_ref, leaves)):
        if a is None or b is None:  # a state that no output reads (every row restarts at once)
            assert a is None or not a.any(), "a dropped state got a gradient"
            continue
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("continues", [False, True])
def test_linear_chunked_form_on_the_gpu_path_equals_each_document_alone(continues):
    # on CUDA no host check picks the rows that restart: both running sums are made, each row takes its own
    tensors, state = tensors_of("linear", 37)
    state = state if continues else None
    starts = document_starts_of(37, continues=continues)
    with simulate_cuda.simulating():
        y, final = run_form("linear", "chunked", tensors, state, starts, 8)
    y_ref, final_ref = by_document("linear", tensors, state, starts)
    torch.testing.assert_close(y, y_ref)
    for a, b in zip(final, final_ref):
        torch.testing.assert_close(a, b)
    leaves = tensors + (state or [])
    for a, b in zip(probe_grads([y, *final], leaves), probe_grads([y_ref, *final_ref], leaves)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("mixer, form", FORMS)
def test_no_gradient_reaches_an_earlier_document(mixer, form):
    # exactly zero, not rounding's residue of cancelling terms: row 0's outputs from its document starting at
    # `cut` (in the middle of a chunk) on send nothing to its tokens before
    tensors, _ = tensors_of(mixer, 37, seed=5)
    starts = document_starts_of(37)
    cut = 19
    starts[0, cut] = True
    y, _ = run_form(mixer, form, tensors, None, starts, 8)
    for grad in torch.autograd.grad(y[0, :, cut:].square().sum(), tensors):
        assert not grad[0, :, :cut].any() and grad[0, :, cut:].any()


@pytest.mark.parametrize("mixer", MIXERS)
def test_layer_sends_no_gradient_to_an_earlier_document(mixer):
    layer = tiny_mixer(mixer)
    for param in (p for name, p in layer.named_parameters() if name.endswith("weight") and "gate" in name):
        param.data.normal_(0, 0.3)  # gates that depend on the input (mLSTM's start at zero weights)
    x = torch.randn(ROWS, 37, 16, generator=generator(6), dtype=torch.float64, requires_grad=True)
    docs = packed_documents(ROWS, 37, lengths=(1, 12), seed=6)
    docs[0, 19:] = torch.maximum(docs[0, 19:], torch.tensor(19))
    layer(x, torch.arange(37), docs=docs)[0, 19:].square().sum().backward()
    assert not x.grad[0, :19].any() and x.grad[0, 19:].any()


@pytest.mark.parametrize("mixer", MIXERS)
def test_end_of_text_at_the_last_position_and_documents_in_every_chunk(mixer):
    tensors, _ = tensors_of(mixer, 64, seed=2)
    starts = document_starts_of(64, eot_last=True, seed=2)
    assert starts[0, -1]
    y_ref, _ = by_document(mixer, tensors, None, starts)
    for form, chunk in (("chunked", 16), ("chunked", 1), ("chunked", 64), ("recurrent", 1)):
        torch.testing.assert_close(run_form(mixer, form, tensors, None, starts, chunk)[0], y_ref)


def assert_rows_equal(with_docs, without, rows):
    """The given rows of two forms' results (output, final state or None) are equal bit for bit."""
    assert torch.equal(with_docs[0][rows], without[0][rows])
    for a, b in zip(with_docs[1] or [], without[1] or []):
        assert torch.equal(a[rows], b[rows])


@pytest.mark.parametrize("simulate", [False, True])
@pytest.mark.parametrize("mixer, form", FORMS)
def test_documents_without_a_boundary_change_no_bit(mixer, form, simulate):
    # a sequence that is one document: its first token begins it (nothing before it to drop), or, continuing a
    # state, no token does; alone, and as the last row of packed_documents beside rows with boundaries. simulate:
    # the CPU standing in for CUDA, where nothing may ask the data on the host
    tensors, state = ([t.detach() for t in group] for group in tensors_of(mixer, 37))
    one = torch.zeros(ROWS, 37, dtype=torch.bool)
    one[:, 0] = True
    cases = [(None, one, slice(None)), (state, torch.zeros_like(one), slice(None)),
             (None, document_starts_of(37), -1), (state, document_starts_of(37, continues=True), -1)]
    with simulate_cuda.simulating(simulate):
        for state_in, starts, rows in cases:
            if form == "reference" and state_in is not None:
                continue  # the references here start from zero
            assert_rows_equal(*(run_form(mixer, form, tensors, state_in, s, 8) for s in (starts, None)), rows)


@pytest.mark.parametrize("simulate", [False, True])
def test_short_convolution_reads_no_earlier_document(simulate):
    # simulate: the CPU standing in for CUDA, where the outputs to mask cannot be found on the host
    n, channels, width = 23, 6, 4
    g = generator(3)
    x = torch.randn(ROWS, n, channels, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(channels, 1, width, generator=g, dtype=torch.float64, requires_grad=True)
    state = torch.randn(ROWS, channels, width - 1, generator=g, dtype=torch.float64)
    pos = torch.arange(n)
    docs = packed_documents(ROWS, n, lengths=(1, 6), seed=3, eot_last=True)
    cuts = [sorted({0, n, *begins_document(docs, pos)[b].nonzero().flatten().tolist()}) for b in range(ROWS)]
    y_ref = torch.cat([torch.cat([causal_conv(x[b:b + 1, s:e], weight)[0] for s, e in zip(c[:-1], c[1:])], 1)
                       for b, c in enumerate(cuts)])
    with simulate_cuda.simulating(simulate):
        y, tail = causal_conv(x, weight, reach=pos - docs)
        # a document that began one token before x: of the state, its last input alone is read
        continued = causal_conv(x, weight, state, reach=pos.expand(ROWS, n) + 1)[0]
        # one document: bit for bit the convolution without documents, from zeros and continuing a state
        assert torch.equal(causal_conv(x, weight, reach=pos.expand(ROWS, n))[0], causal_conv(x, weight)[0])
        assert torch.equal(causal_conv(x, weight, state, reach=pos.expand(ROWS, n) + 5)[0],
                           causal_conv(x, weight, state)[0])
        assert torch.equal(y[-1], causal_conv(x, weight)[0][-1])  # the row without a boundary, beside others
    torch.testing.assert_close(y, y_ref)
    for a, b in zip(probe_grads([y], [x, weight]), probe_grads([y_ref], [x, weight])):
        torch.testing.assert_close(a, b)
    assert torch.equal(tail, causal_conv(x, weight)[1])  # the state keeps the raw inputs: readers mask them
    torch.testing.assert_close(continued, causal_conv(x, weight, F.pad(state[..., -1:], (width - 2, 0)))[0])


def tiny_config(mixer, **kw):
    cfg = dict(arch="llama", n_layer=2, n_head=2, n_embd=16, block_size=64, vocab_size=50, bias=False,
               attn_pattern=mixer, mlstm_n_head=2, mlstm_chunk=8, gdn_chunk=8, linear_chunk=8, linear_feature_dim=4)
    cfg.update(kw)
    return ModelConfig(**cfg)


def tiny_mixer(mixer):
    torch.manual_seed(0)
    return GPT(tiny_config(mixer)).double().blocks[0].mixer.eval()


@pytest.mark.parametrize("mixer", MIXERS)
def test_layer_equals_each_document_alone_with_gradients(mixer):
    # the whole layer (projections, Gated DeltaNet's convolutions, RoPE at the window's positions, norms, gates)
    layer = tiny_mixer(mixer)
    n = 45
    x = torch.randn(ROWS, n, 16, generator=generator(4), dtype=torch.float64, requires_grad=True)
    pos = torch.arange(n) + 3  # a window that does not begin at 0
    docs = packed_documents(ROWS, n, lengths=(1, 20), seed=4, eot_last=True) + 3
    y = layer(x, pos, docs=docs)
    starts = begins_document(docs, pos)
    pieces = []
    for b in range(ROWS):
        cuts = sorted({0, n, *starts[b].nonzero().flatten().tolist()})
        pieces.append(torch.cat([layer(x[b:b + 1, s:e], pos[s:e]) for s, e in zip(cuts[:-1], cuts[1:])], 1))
    y_ref = torch.cat(pieces)
    torch.testing.assert_close(y, y_ref)
    leaves = [x, *layer.parameters()]
    for a, b in zip(probe_grads([y], leaves), probe_grads([y_ref], leaves)):
        torch.testing.assert_close(a, b)
    # one document, in every row or in the last beside others: bit for bit the layer without documents
    without = layer(x, pos)
    assert torch.equal(layer(x, pos, docs=torch.full_like(docs, 3)), without)
    assert torch.equal(y[-1], without[-1])


@pytest.mark.parametrize("mixer", MIXERS)
def test_cached_generation_equals_one_pass_across_documents(mixer):
    # a prompt (its own chunked pass from the cache), then one token at a time: each new token that begins a
    # document resets its row's state and its convolution taps; docs then cover the new tokens alone
    layer = tiny_mixer(mixer)
    n, prompt = 40, 13
    x = torch.randn(ROWS, n, 16, generator=generator(5), dtype=torch.float64)
    pos = torch.arange(n)
    docs = packed_documents(ROWS, n, lengths=(1, 9), seed=5, eot_last=True)
    full = layer(x, pos, docs=docs)
    cache = layer.init_cache(ROWS, n, x.device, x.dtype)
    outputs = [layer(x[:, :prompt], pos[:prompt], cache, docs=docs[:, :prompt])]
    for t in range(prompt, n):
        outputs.append(layer(x[:, t:t + 1], pos[t:t + 1], cache, docs=docs[:, t:t + 1]))
    torch.testing.assert_close(torch.cat(outputs, 1), full)


@pytest.mark.parametrize("mixer", MIXERS)
def test_model_with_document_mask_generates_as_it_scores(mixer):
    # GPT.forward finds the documents from the end-of-text tokens (eot_id 7 here) and carries them across calls
    torch.manual_seed(0)
    model = GPT(tiny_config(mixer, document_mask=True, eot_id=7)).double().eval()
    idx = torch.randint(8, 50, (2, 40), generator=generator(6))
    idx[0, [0, 5, 6, 21, 39]] = 7
    idx[1, [17, 30]] = 7
    full, _ = model(idx)
    torch.testing.assert_close(cached_logits(model, idx, 11), full)
    # the first document's logits are the model's on it alone
    torch.testing.assert_close(full[1:, :17], model(idx[1:, :17])[0])


@pytest.mark.parametrize("mixer", MIXERS)
def test_training_form_with_documents_never_builds_an_n_by_n_tensor(mixer):
    n, chunk = 2048, 64
    tensors, _ = tensors_of(mixer, n, dtype=torch.float32)
    tensors = [t.detach()[:1, :1].requires_grad_() for t in tensors]
    starts = document_starts_of(n)[:1]
    with LargestTensor() as largest:
        y, _ = run_form(mixer, "chunked", tensors, None, starts, chunk)
        y.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in tensors)
    assert largest.numel <= n * chunk, largest.shape


def test_simulated_triton_mlstm_closes_the_forget_gate_at_document_starts():
    # mlstm_kernels' kernel takes no documents: it gets forget gates of sigmoid(-50) at their first tokens. Its
    # CPU stand-in (the same contract, in float32) against the exact masks: the dropped zero-state stabiliser
    # and the rounding of cumulative gates near -50 stay far below float32 training noise
    tensors, _ = tensors_of("mlstm", 150, dtype=torch.float32)
    starts = document_starts_of(150, eot_last=True)
    exact, _ = chunkwise_mlstm(*tensors, chunk=64, starts=starts)
    with simulate_cuda.simulating():
        closed, state = mlstm_sequence(*tensors, kernel="triton", need_state=False, starts=starts)
    assert state is None  # the kernel's path ran
    torch.testing.assert_close(closed, exact, rtol=1e-4, atol=1e-5)
    ours, theirs = probe_grads([closed], tensors), probe_grads([exact], tensors)
    for a, b in zip(ours[:4], theirs[:4]):  # q, k, v, i
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # the forget gate at a start reaches only the zero state's stabiliser, through eps: no gradient in the kernel
    torch.testing.assert_close(ours[4], theirs[4].where(~starts[:, None], 0), rtol=1e-4, atol=1e-4)
    # the row without a boundary: the kernel's own bits
    with simulate_cuda.simulating():
        plain, _ = mlstm_sequence(*tensors, kernel="triton", need_state=False)
    assert torch.equal(closed[-1], plain[-1])


def test_simulated_fla_gated_deltanet_forgets_the_state_at_document_starts():
    # fla's kernel takes no documents either: its log decay is -30 at their first tokens; the layer through
    # fla's CPU stand-in against the same weights through the exact native form, forward and backward
    with simulate_cuda.simulating():
        torch.manual_seed(0)
        fla = GPT(tiny_config("gated_deltanet", gdn_kernel="fla")).blocks[0].mixer
        assert fla.fla_kernel_for(torch.device("cpu"), torch.float32) is not None
    torch.manual_seed(0)
    native = GPT(tiny_config("gated_deltanet", gdn_kernel="native")).blocks[0].mixer
    native.load_state_dict(fla.state_dict())
    x = torch.randn(ROWS, 70, 16, generator=generator(7), requires_grad=True)
    pos = torch.arange(70)
    docs = packed_documents(ROWS, 70, lengths=(1, 30), seed=7, eot_last=True)
    with simulate_cuda.simulating():
        y = fla(x, pos, docs=docs)
        assert torch.equal(y[-1], fla(x, pos)[-1])  # the row without a boundary: the kernel's own bits
    y_ref = native(x, pos, docs=docs)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    # gradients as a whole: at initialisation a document's first read (its own token alone) is ~1e-5, below the
    # output norm's eps, which magnifies the two forms' float32 rounding of it in that token's gradient
    grad, grad_ref = probe_grads([y], [x])[0], probe_grads([y_ref], [x])[0]
    assert (grad - grad_ref).norm() <= 2e-3 * grad_ref.norm()


def test_restarting_sums_keep_float32_close_over_a_long_row():
    # Taylor linear attention's running sums restart by subtracting the sum at a document's chunk: over 8192
    # tokens and short documents the float32 result stays within float32 noise of the float64 one
    tensors, _ = tensors_of("linear", 8192, dtype=torch.float64)
    tensors = [t.detach()[:1, :1] for t in tensors]
    starts = document_starts_of(8192, seed=8)[:1]
    exact, _ = chunked_linear_attention(*tensors, chunk=64, starts=starts)
    single, _ = chunked_linear_attention(*(t.float() for t in tensors), chunk=64, starts=starts)
    torch.testing.assert_close(single.double(), exact, rtol=1e-4, atol=1e-5)


if torch.cuda.is_available():

    @pytest.mark.gpu
    @pytest.mark.parametrize("mixer", ["mlstm", "gated_deltanet"])
    def test_cuda_kernels_with_documents_equal_native_forms_in_bf16(mixer, device):
        # the real Triton kernels (mlstm_kernels', fla's) on packed documents, against the native forms' exact
        # masks on the same weights, under bf16 autocast: each kernel's own tolerance of its test without docs
        from attention.ops.gated_deltanet.fla_kernel import fla_chunk_kernel
        from attention.ops.mlstm.op import triton_available

        kernel = {"mlstm": dict(mlstm_kernel="triton"), "gated_deltanet": dict(gdn_kernel="fla")}[mixer]
        if not (triton_available() if mixer == "mlstm" else fla_chunk_kernel() is not None):
            pytest.skip(f"{mixer}'s GPU kernel is not installed")
        cfg = tiny_config(mixer, n_head=2, n_embd=128, mlstm_n_head=2, block_size=256, document_mask=True, eot_id=7,
                          **kernel)
        reference = dataclasses.replace(cfg, mlstm_kernel="native", gdn_kernel="native")
        torch.manual_seed(0)
        models = [GPT(cfg).to(device), GPT(reference).to(device)]
        models[1].load_state_dict(models[0].state_dict())
        idx = torch.randint(8, 50, (2, 200), generator=generator(1, device), device=device)
        idx[0, [0, 3, 4, 90, 199]] = 7
        idx[1, [64, 65, 130]] = 7
        outputs = []
        for model in models:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, _ = model(idx)
            logits.float().square().mean().backward()
            outputs.append([logits.float(), *(p.grad for p in model.parameters())])
        for a, b in zip(*outputs):
            assert ((a - b).norm() / b.norm()).item() <= 5e-2
