"""mLSTM: its cell's chunked == parallel == one-step forms (on the recurrence core) and == mlstm_kernels' own sequence
kernel, forward and backward; prefill then steps; the gate initialisation; no n x n tensor on the training path;
the layer in a model."""

import dataclasses

import pytest
import torch

from attention.mlstm import soft_cap
from attention.ops.mlstm.cell import mlstm_cell
from attention.ops.recurrence import State
from config import ModelConfig
from conftest import assert_models_agree_in_bf16, generator
from helpers import LargestTensor, cached_logits
from model import GPT


def inputs(n, dk=4, dv=6, seed=0, dtype=torch.float64, realistic=False, device=None):
    """q, k, v and gate pre-activations (B=2, H=3). realistic: gates near the layer's initialisation
    (input -10, forget 3..6), where the stabiliser matters most."""
    g = generator(seed, device)
    q, k = (torch.randn(2, 3, n, dk, generator=g, dtype=dtype, device=device) for _ in range(2))
    v = torch.randn(2, 3, n, dv, generator=g, dtype=dtype, device=device)
    i = torch.randn(2, 3, n, generator=g, dtype=dtype, device=device) * 3 + (-10 if realistic else -1)
    f = torch.randn(2, 3, n, generator=g, dtype=dtype, device=device) * 2 + (4 if realistic else 1)
    return [t.requires_grad_() for t in (q, k, v, i, f)]


def initial_state(dk=4, dv=6, dtype=torch.float64):
    """(C, n, m), as xLSTM 7B's kernels keep the state."""
    g = torch.Generator().manual_seed(7)
    return (torch.randn(2, 3, dk, dv, generator=g, dtype=dtype), torch.randn(2, 3, dk, generator=g, dtype=dtype),
            torch.randn(2, 3, 1, generator=g, dtype=dtype))


def as_core(state):
    """(C, n, m) as the recurrence core's State: n is the column of C for v's appended column of ones."""
    return None if state is None else State(torch.cat([state[0], state[1][..., None]], -1), state[2])


def as_cmn(state):
    return state.S[..., :-1], state.S[..., -1], state.m


def quadratic_mlstm(*tensors, state=None):
    return mlstm_cell(*tensors, as_core(state), form="parallel")[0]


def chunkwise_mlstm(*tensors, state=None, chunk=64):
    h, final = mlstm_cell(*tensors, as_core(state), chunk=chunk)
    return h, as_cmn(final)


def recurrent_mlstm(*tensors, state=None):
    h, final = mlstm_cell(*tensors, as_core(state), form="step")
    return h, as_cmn(final)


def grads(y, tensors):
    probe = torch.randn(y.shape, generator=generator(1, y.device), dtype=y.dtype, device=y.device)
    return torch.autograd.grad(y, tensors, probe)


@pytest.mark.parametrize("n, chunk", [(37, 8), (64, 16), (5, 8), (1, 4)])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("realistic", [False, True])
def test_three_forms_agree_forward_and_backward_fp64(n, chunk, with_state, realistic):
    tensors = inputs(n, realistic=realistic)
    state = initial_state() if with_state else None
    ref = quadratic_mlstm(*tensors, state=state)
    chunked, chunk_state = chunkwise_mlstm(*tensors, state=state, chunk=chunk)
    recurrent, rec_state = recurrent_mlstm(*tensors, state=state)
    # fp64: torch's default tolerances (rtol 1e-7, atol 1e-7)
    torch.testing.assert_close(chunked, ref)
    torch.testing.assert_close(recurrent, ref)
    for a, b in zip(chunk_state, rec_state):
        torch.testing.assert_close(a, b)
    for a, b, c in zip(grads(ref, tensors), grads(chunked, tensors), grads(recurrent, tensors)):
        torch.testing.assert_close(b, a)
        torch.testing.assert_close(c, a)


def test_forms_agree_in_float32_within_stated_tolerance():
    tensors = inputs(200, dk=16, dv=16, dtype=torch.float32, realistic=True)
    ref = quadratic_mlstm(*tensors)
    chunked, _ = chunkwise_mlstm(*tensors, chunk=64)
    recurrent, _ = recurrent_mlstm(*tensors)
    torch.testing.assert_close(chunked, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(recurrent, ref, atol=1e-5, rtol=1e-4)
    for a, b in zip(grads(ref, tensors), grads(chunked, tensors)):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-3)


def test_equals_mlstm_kernels_native_sequence_kernel():
    from mlstm_kernels.torch.chunkwise.native import mlstm_chunkwise__native_autograd
    from mlstm_kernels.torch.recurrent.native_sequence import mlstm_recurrent_sequence__native_fw

    q, k, v, i, f = (t.detach() for t in inputs(64, realistic=True))
    state = initial_state()
    ours, our_state = chunkwise_mlstm(q, k, v, i, f, state=state, chunk=16)
    theirs, their_state = mlstm_recurrent_sequence__native_fw(
        q, k, v, i, f, *state, return_last_states=True, dtype_state=torch.float64)
    torch.testing.assert_close(ours, theirs)
    for a, b in zip(our_state, their_state):
        torch.testing.assert_close(a, b)
    # and their chunkwise form, from a zero state, in float32 (their native kernels' working precision)
    q, k, v, i, f = (t.float() for t in (q, k, v, i, f))
    theirs = mlstm_chunkwise__native_autograd(q, k, v, i, f, chunk_size=16)
    torch.testing.assert_close(chunkwise_mlstm(q, k, v, i, f, chunk=16)[0], theirs, atol=1e-5, rtol=1e-4)


def test_mlstm_kernels_chunkwise_backward_treats_the_normaliser_as_a_constant():
    # The Triton kernel's backward implements mlstm_kernels' hand-written chunkwise backward (their
    # native_custbw, equal to it on a GPU), which divides the output's gradient by the saved normaliser
    # max(|n . q|, exp(-m)) and sends no gradient through it. So dv is exact, and dq, dk, di, df differ from
    # the exact gradient (our forms' autograd, equal to their own autograd form) at the positions where |n . q|
    # is the larger: rare near the layer's initialisation, most positions with wider gates.
    # docs/history/benchmarks-2026-11.md ("On an NVIDIA H200 (2026-11-25)") has the measurements;
    # mlstm_kernel=native trains exactly.
    from mlstm_kernels.torch.chunkwise.native import mlstm_chunkwise__native_autograd, mlstm_chunkwise__native_custbw

    for realistic in (True, False):
        tensors = inputs(256, dk=16, dv=16, realistic=realistic)
        exact = grads(chunkwise_mlstm(*tensors, chunk=64)[0], tensors)
        theirs_exact = grads(mlstm_chunkwise__native_autograd(*tensors, chunk_size=64), tensors)
        theirs = grads(mlstm_chunkwise__native_custbw(*tensors, chunk_size=64), tensors)
        for a, b in zip(exact, theirs_exact):
            torch.testing.assert_close(b, a)
        torch.testing.assert_close(theirs[2], exact[2])  # dv
        for a, b in zip(exact[:2] + exact[3:], theirs[:2] + theirs[3:]):  # dq, dk, di, df
            assert ((b - a).abs() > 1e-2 + 1e-2 * a.abs()).any()


def test_prefill_then_steps_equals_one_pass():
    q, k, v, i, f = (t.detach() for t in inputs(30))
    full, full_state = chunkwise_mlstm(q, k, v, i, f, chunk=8)
    first, state = chunkwise_mlstm(*(t[:, :, :17] for t in (q, k, v, i, f)), chunk=8)
    rest, last_state = recurrent_mlstm(*(t[:, :, 17:] for t in (q, k, v, i, f)), state=state)
    torch.testing.assert_close(torch.cat([first, rest], dim=2), full)
    for a, b in zip(last_state, full_state):
        torch.testing.assert_close(a, b)


def test_long_sequence_at_initial_gates_is_finite_and_never_builds_an_n_by_n_tensor():
    n, chunk = 8192, 64
    q, k, v, i, f = (t.detach().float()[:1, :1].requires_grad_() for t in inputs(n, realistic=True))
    with LargestTensor() as largest:
        h, _ = chunkwise_mlstm(q, k, v, i, f, chunk=chunk)
        h.sum().backward()
    assert torch.isfinite(h).all() and torch.isfinite(q.grad).all() and torch.isfinite(f.grad).all()
    assert largest.numel <= n * chunk, largest.shape  # chunk x chunk tiles per chunk, never n x n


def tiny(pattern="mlstm", **kw):
    cfg = dict(arch="llama", n_layer=2, n_head=2, n_embd=16, block_size=64, vocab_size=50, bias=False,
               attn_pattern=pattern, swa_window=8, mlstm_chunk=8)
    cfg.update(kw)
    torch.manual_seed(0)
    return GPT(ModelConfig(**cfg)).double().eval()


def test_gate_initialisation_and_soft_cap():
    assert tiny(n_embd=32).blocks[0].mixer.n_head == 8  # xLSTM 7B's memory heads by default, whatever n_head is
    model = tiny(n_head=2, n_embd=32, mlstm_n_head=4)  # the memory's heads are set apart from the attention's
    for block in model.blocks:
        mixer = block.mixer
        assert torch.equal(mixer.i_gate.bias, torch.full((4,), -10.0, dtype=torch.float64))
        torch.testing.assert_close(mixer.f_gate.bias, torch.tensor([3.0, 4.0, 5.0, 6.0], dtype=torch.float64))
        assert not mixer.i_gate.weight.any() and not mixer.f_gate.weight.any()
        assert mixer.q.weight.shape == (16, 32) and mixer.v.weight.shape == (32, 32)  # q, k of width d/2
    x = torch.tensor([-1000.0, -15.0, 0.0, 15.0, 1000.0])
    torch.testing.assert_close(soft_cap(x, 15.0), 15 * torch.tanh(x / 15))
    assert soft_cap(x, 15.0).abs().max() <= 15


@pytest.mark.parametrize("pattern", ["mlstm", "swa,mlstm"])
def test_model_cached_generation_equals_uncached_and_single_pass(pattern):
    model = tiny(pattern)
    idx = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(3))
    full, _ = model(idx)
    torch.testing.assert_close(cached_logits(model, idx, 23), full)
    prompt = idx[:, :10]
    torch.testing.assert_close(model.generate(prompt, 20, temperature=0, use_cache=True),
                               model.generate(prompt, 20, temperature=0, use_cache=False))


def test_layer_is_causal_and_trains():
    model = tiny("swa,mlstm").float().train()
    idx = torch.randint(0, 50, (2, 33), generator=torch.Generator().manual_seed(4))
    changed = idx.clone()
    changed[:, 20] = (idx[:, 20] + 1) % 50
    a, b = model(idx)[0], model(changed)[0]
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert model.blocks[1].mixer.i_gate.weight.grad.abs().sum() > 0  # gradients reach the gates


def test_config_errors():
    from attention import validate_config

    for bad in (dict(mlstm_qk_dim_factor=0.1), dict(mlstm_chunk=0), dict(mlstm_kernel="cuda"),
                dict(mlstm_gate_soft_cap=0.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            validate_config(ModelConfig(n_layer=2, n_head=2, n_embd=16, attn_pattern="mlstm", **bad))


def test_bf16_autocast_keeps_the_cell_in_float32(monkeypatch):
    import attention.mlstm as mlstm_module

    seen = []
    original = mlstm_module.mlstm_sequence

    def spy(q, k, v, i, f, *args, **kwargs):
        seen.append({t.dtype for t in (q, k, v, i, f)})
        out = original(q, k, v, i, f, *args, **kwargs)
        seen.append({out[0].dtype})
        return out

    monkeypatch.setattr(mlstm_module, "mlstm_sequence", spy)
    model = tiny("swa,mlstm").float()
    idx = torch.randint(0, 50, (2, 48), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full, _ = model(idx)
        seen.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low, _ = model(idx)
    assert seen and all(dtypes == {torch.float32} for dtypes in seen)  # the cell's inputs and output
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), full, atol=3e-2, rtol=0)


from attention.ops.mlstm.op import mlstm_sequence, triton_available  # noqa: E402


def test_triton_kernel_only_for_heads_of_at_least_16(monkeypatch):
    # mlstm_kernels sizes its blocks by the head widths, and Triton's tl.dot needs 16: narrower heads use the
    # built-in form under mlstm_kernel=auto (said in the layer's start-up line) and are refused under triton
    import attention.mlstm as mlstm
    from attention import validate_config

    monkeypatch.setattr(mlstm, "triton_available", lambda: True)  # as on a CUDA machine with the package
    narrow = ModelConfig(arch="llama", n_layer=2, n_head=4, n_embd=64, vocab_size=50, attn_pattern="mlstm",
                         mlstm_n_head=4)  # q/k 8, v 16 per head: gpu_check's compile-check model
    layer = GPT(narrow).blocks[0].mixer
    assert not layer.triton and "needs both >= 16" in layer.describe() and "kernel native" in layer.describe()
    wide = dataclasses.replace(narrow, n_embd=256)  # q/k 32, v 64
    assert GPT(wide).blocks[0].mixer.triton
    assert "kernel triton" in GPT(wide).blocks[0].mixer.describe()
    with pytest.raises(ValueError, match="mlstm_kernel=triton: q/k and v head widths 8 and 16"):
        validate_config(dataclasses.replace(narrow, mlstm_kernel="triton"))
    assert GPT(wide).blocks[0].mixer.mixing_flops(1024) == pytest.approx(
        GPT(dataclasses.replace(wide, mlstm_chunk=mlstm.TRITON_CHUNK, mlstm_kernel="native")).blocks[0].mixer.mixing_flops(1024))
    assert GPT(dataclasses.replace(wide, mlstm_chunk=16)).blocks[0].mixer.mixing_flops(1024) == pytest.approx(
        GPT(wide).blocks[0].mixer.mixing_flops(1024))  # the Triton kernel runs its own chunk whatever mlstm_chunk

@pytest.mark.gpu  # on CUDA where it exists, else on the CPU under the device guard (tests/conftest.py)
def test_gpu_native_chunkwise_equals_quadratic_forward_and_backward(device):
    tensors = inputs(300, dk=16, dv=32, dtype=torch.float32, realistic=True, device=device)
    ref = quadratic_mlstm(*tensors)
    out, _ = chunkwise_mlstm(*tensors, chunk=64)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-3)
    for a, b in zip(grads(ref, tensors), grads(out, tensors)):
        torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-2)


@pytest.mark.gpu
def test_gpu_model_gradients_do_not_depend_on_the_chunk_in_bf16(device):
    # the built-in form's chunk is an implementation choice: logits and gradients of a model agree across chunks
    # under bf16 autocast (the same comparison as the Triton kernel's below, which runs where it is installed)
    cfg = ModelConfig(arch="llama", n_layer=2, n_head=2, n_embd=128, block_size=256, vocab_size=50, bias=False,
                      attn_pattern="mlstm", mlstm_n_head=2, mlstm_kernel="native", mlstm_chunk=64)
    assert_models_agree_in_bf16(cfg, dataclasses.replace(cfg, mlstm_chunk=16), device, 3e-2)


if torch.cuda.is_available() and triton_available():  # where the optional Triton path can run

    @pytest.mark.gpu
    def test_cuda_triton_kernel_equals_native_chunkwise_and_mlstm_kernels_backward(device):
        # The forward against our chunkwise form; the gradients against mlstm_kernels' own chunkwise backward,
        # which the Triton kernels implement (it treats the normaliser as a constant: the test above), dv also
        # against the exact gradient. Float32 inputs: the kernel's tl.dot runs them in TF32 (Triton's
        # default), hence the tolerances; gates near the layer's initialisation (wider gates make TF32's error
        # larger than any fixed tolerance: docs/history/benchmarks-2026-11.md). A length that is not a multiple
        # of the kernel's chunk: the padding must change no output.
        from mlstm_kernels.torch.chunkwise.native import mlstm_chunkwise__native_custbw

        for n in (200, 256):  # mlstm_kernels' own chunkwise form takes whole chunks only
            tensors = inputs(n, dk=64, dv=64, dtype=torch.float32, realistic=True, device=device)
            ref, _ = chunkwise_mlstm(*tensors, chunk=64)
            out, state = mlstm_sequence(*tensors, kernel="triton", need_state=False)
            assert state is None  # the Triton path ran
            torch.testing.assert_close(out, ref, atol=1e-3 * ref.abs().max().item(), rtol=1e-2)
            ours, exact = grads(out, tensors), grads(ref, tensors)
            torch.testing.assert_close(ours[2], exact[2], atol=1e-2 * exact[2].abs().max().item(), rtol=1e-2)
        theirs = grads(mlstm_chunkwise__native_custbw(*tensors, chunk_size=64), tensors)
        for a, b in zip(theirs, ours):
            torch.testing.assert_close(b, a, atol=1e-2 * a.abs().max().item(), rtol=1e-2)

    @pytest.mark.gpu
    def test_cuda_triton_kernel_in_bfloat16_and_compiled_without_graph_breaks(device):
        # bf16 training: q, k, v reach the kernel in bf16 (gates in float32), close to the float32 native form;
        # and the kernel is one opaque op inside a compiled block (no graph break)
        tensors = [t.detach() for t in inputs(256, dk=64, dv=64, dtype=torch.float32, realistic=True, device=device)]
        ref, _ = chunkwise_mlstm(*tensors, chunk=64)
        q, k, v, i, f = tensors
        low, _ = mlstm_sequence(q.bfloat16(), k.bfloat16(), v.bfloat16(), i, f, kernel="triton", need_state=False)
        assert low.dtype == torch.bfloat16
        torch.testing.assert_close(low.float(), ref, atol=5e-2, rtol=5e-2)
        torch._dynamo.reset()
        compiled = torch.compile(lambda *t: mlstm_sequence(*t, kernel="triton", need_state=False)[0], fullgraph=True)
        torch.testing.assert_close(compiled(q.bfloat16(), k.bfloat16(), v.bfloat16(), i, f).float(), low.float())

    @pytest.mark.gpu
    def test_cuda_triton_model_equals_native_model_with_gradients_in_bf16(device):
        # model level: the logits and every parameter's gradient of a 2-layer mLSTM model with the Triton kernel,
        # against the same weights through the built-in chunkwise form, both under bf16 autocast: within 3e-2
        # relative (the Triton kernel's matmuls run in bf16, the built-in form's in float32)
        cfg = ModelConfig(arch="llama", n_layer=2, n_head=2, n_embd=128, block_size=256, vocab_size=50, bias=False,
                          attn_pattern="mlstm", mlstm_n_head=2, mlstm_kernel="triton")
        assert_models_agree_in_bf16(cfg, dataclasses.replace(cfg, mlstm_kernel="native"), device, 3e-2)
