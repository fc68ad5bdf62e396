"""Packed documents in what the recurrent mixers add to the recurrence core (whose forms
tests/ops/test_recurrence.py holds to each document run alone; the layers' own checks are the conformance kit's,
tests/models/test_conformance.py): Gated DeltaNet's short convolutions read no earlier document, and the GPU
kernels that take no documents (mlstm_kernels', fla's; their CPU stand-ins) stay close to the exact forms with
their gates closed at a document's first token."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from attention import simulate_cuda
from attention.call import MixerCall
from attention.documents import begins_document
from attention.ops.gated_deltanet.conv import causal_conv
from attention.ops.mlstm.cell import mlstm_cell
from attention.ops.mlstm.op import mlstm_sequence
from config import ModelConfig
from conftest import generator
from helpers import packed_documents
from model import GPT

ROWS = 3


def document_starts_of(n, eot_last=False, seed=0):
    """starts (3, n) of packed documents of 1 to 12 tokens (row 0 with one at its first token and one of length 1,
    the last row with none)."""
    docs = packed_documents(ROWS, n, lengths=(1, 12), seed=seed, eot_last=eot_last)
    return begins_document(docs, torch.arange(n))


def mlstm_inputs(n, dtype=torch.float32):
    """q, k, v (3 rows, 2 heads) and gate pre-activations near the layer's initialisation (input -10, forget
    3..6), requiring grads."""
    g = generator(0)
    randn = lambda *shape: torch.randn(ROWS, 2, *shape, generator=g, dtype=dtype)  # noqa: E731
    return [t.requires_grad_() for t in (randn(n, 4), randn(n, 4), randn(n, 5), randn(n) * 3 - 10, randn(n) * 2 + 4)]


def probe_grads(outputs, tensors):
    """Gradients of the outputs (each weighted by a fixed random tensor) with respect to tensors."""
    g = generator(1)
    weights = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in outputs]
    return torch.autograd.grad(outputs, tensors, weights, allow_unused=True)


def tiny_config(mixer, **kw):
    cfg = dict(arch="llama", n_layer=2, n_head=2, n_embd=16, block_size=64, vocab_size=50, bias=False,
               attn_pattern=mixer, mlstm_n_head=2, mlstm_chunk=8, gdn_chunk=8, linear_chunk=8, linear_feature_dim=4)
    cfg.update(kw)
    return ModelConfig(**cfg)


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


def test_simulated_triton_mlstm_closes_the_forget_gate_at_document_starts():
    # mlstm_kernels' kernel takes no documents: it gets forget gates of sigmoid(-50) at their first tokens. Its
    # CPU stand-in (the same contract, in float32) against the exact masks: the dropped zero-state stabiliser
    # and the rounding of cumulative gates near -50 stay far below float32 training noise
    tensors = mlstm_inputs(150)
    starts = document_starts_of(150, eot_last=True)
    exact, _ = mlstm_cell(*tensors, chunk=64, starts=starts)
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
        y = fla(x, MixerCall(pos, docs=docs))
        assert torch.equal(y[-1], fla(x, MixerCall(pos))[-1])  # the row without a boundary: the kernel's own bits
    y_ref = native(x, MixerCall(pos, docs=docs))
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    # gradients as a whole: at initialisation a document's first read (its own token alone) is ~1e-5, below the
    # output norm's eps, which magnifies the two forms' float32 rounding of it in that token's gradient
    grad, grad_ref = probe_grads([y], [x])[0], probe_grads([y_ref], [x])[0]
    assert (grad - grad_ref).norm() <= 2e-3 * grad_ref.norm()


if torch.cuda.is_available():

    from attention.capabilities import gpu_kernel
    from attention.registry import MIXERS

    @pytest.mark.gpu
    @pytest.mark.parametrize("mixer", [name for name, cls in MIXERS.items() if gpu_kernel(cls) and cls.takes_documents])
    def test_cuda_kernels_with_documents_equal_native_forms_in_bf16(mixer, device):
        # each GPU kernel a mixer declares (mlstm_kernels', fla's) on packed documents, against the native forms'
        # exact masks on the same weights, under bf16 autocast: each kernel's own tolerance of its test without docs
        setting, value = gpu_kernel(MIXERS[mixer])[:2]
        cfg = tiny_config(mixer, n_head=2, n_embd=128, mlstm_n_head=2, block_size=256, document_mask=True, eot_id=7,
                          **{setting: value})
        reference = dataclasses.replace(cfg, **{setting: "native"})
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
