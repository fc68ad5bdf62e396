"""Activation memory: activation checkpointing (full, selective) and the chunked cross-entropy change memory,
never results."""

import copy
import json

import pytest
import torch

from attention.registry import example_cases
from config import ModelConfig
from conftest import train_in_process
from model import GPT, chunked_cross_entropy, token_nll
from runtime.parallelize import apply_activation_checkpointing

CASES = example_cases(32)  # every registered mixer, its check variants and each pattern alias


def model_of(case, dropout=0.1, **kw):
    settings = {"arch": "llama", "n_layer": 4, "n_head": 4, "n_embd": 64, "block_size": 128, "bias": False,
                "vocab_size": 128, "dropout": dropout, **CASES[case], **kw}
    torch.manual_seed(0)
    return GPT(ModelConfig(**settings))


def step(model, idx, loss_chunk=0):
    """One forward and backward from a fixed RNG state: the loss, every gradient by parameter name, and the
    RNG state afterwards (how many random draws the step made)."""
    torch.manual_seed(5)
    _, loss = model(idx[:, :-1], idx[:, 1:], loss_chunk=loss_chunk)
    loss.backward()
    grads = {name.replace("._checkpoint_wrapped_module", ""): p.grad for name, p in model.named_parameters()}
    return loss.detach(), grads, torch.get_rng_state()


@pytest.mark.parametrize("case", sorted(CASES))
def test_checkpointed_gradients_equal_plain_gradients(case):
    # dropout is on: recomputation must replay its masks; sa's permutation is drawn once per forward, before
    # the blocks (GPT.plan), so the recomputation sees the same edges and draws nothing more
    reference = model_of(case)
    idx = torch.randint(0, 128, (2, 129), generator=torch.Generator().manual_seed(1))
    loss, grads, rng = step(copy.deepcopy(reference), idx)
    for mode in ("full", "selective"):
        model = copy.deepcopy(reference)
        apply_activation_checkpointing(model, mode)
        assert model.state_dict().keys() == reference.state_dict().keys()  # checkpoints stay interchangeable
        loss_ac, grads_ac, rng_ac = step(model, idx)
        torch.testing.assert_close(loss_ac, loss, rtol=0, atol=1e-6)
        assert torch.equal(rng_ac, rng)  # the same random draws, no more
        for name, grad in grads.items():
            torch.testing.assert_close(grads_ac[name], grad, rtol=1e-5, atol=1e-6, msg=f"{mode}: {name}")


def test_chunked_cross_entropy_equals_the_plain_loss_forward_and_backward():
    torch.manual_seed(0)
    x = torch.randn(3, 50, 32, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(100, 32, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 100, (3, 50))
    targets[0, :7] = -1  # ignored targets
    plain = token_nll(x @ weight.T, targets)
    chunked = chunked_cross_entropy(x, weight, targets, chunk=16)  # 150 tokens: 16, ..., 16, 6
    torch.testing.assert_close(chunked, plain, rtol=1e-12, atol=0)
    for a, b in zip(torch.autograd.grad(plain, (x, weight)), torch.autograd.grad(chunked, (x, weight))):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    model = model_of("swa", dropout=0.0)
    idx = torch.randint(0, 128, (2, 129))
    logits, loss = model(idx[:, :-1], idx[:, 1:])
    none, chunked_loss = model(idx[:, :-1], idx[:, 1:], loss_chunk=100)
    assert none is None and logits.shape == (2, 128, 128)  # the chunked path keeps no logits
    torch.testing.assert_close(chunked_loss, loss, rtol=1e-6, atol=1e-6)


def test_the_chunked_loss_never_holds_the_whole_batch_of_logits():
    from helpers import LargestTensor

    model = model_of("swa", dropout=0.0, vocab_size=2048)  # the logits are the largest tensor by far
    idx = torch.randint(0, 2048, (4, 129))
    with LargestTensor() as seen:
        _, loss = model(idx[:, :-1], idx[:, 1:], loss_chunk=64)
        loss.backward()
    assert seen.numel == 64 * 2048  # one chunk's logits at a time, forward and backward
    with LargestTensor() as seen:
        model(idx[:, :-1], idx[:, 1:])[1].backward()
    assert seen.numel == 4 * 128 * 2048  # while the plain path holds the whole (B, T, vocab) (the check sees it)


TRAIN = ["configs/quickstart.py", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=64", "--batch_size=4",
         "--eval_iters=2", "--log_interval=1", "--max_iters=20", "--eval_interval=10", "--warmup_iters=2",
         "--lr_decay_iters=20", "--dropout=0.1"]


def train_losses(tmp_path, name, args):
    out = tmp_path / name
    train_in_process([*TRAIN, f"--out_dir={out}", *args])  # the run as python train.py runs it, in this process
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return {(r["step"], key): r[key] for r in records for key in ("train_loss", "val_loss") if key in r}


@pytest.mark.parametrize("model_args", [
    ["--arch=gpt2", "--attn_pattern=full"],
    ["--arch=llama", "--bias=False", "--attn_pattern=sa_swa", "--swa_window=16"],
    ["--arch=llama", "--bias=False", "--attn_pattern=swax", "--swa_window=32", "--window_schedule=stochastic",
     "--swax_short_window=8"],
], ids=["gpt2-full", "llama-sa_swa", "swax-stochastic"])
@pytest.mark.e2e
def test_checkpointed_chunked_loss_training_equals_plain_training(tmp_path, model_args):
    plain = train_losses(tmp_path, "plain", model_args)
    for mode in ("full", "selective"):
        lean = train_losses(tmp_path, mode, [*model_args, f"--activation_checkpointing={mode}", "--loss_chunk=96"])
        assert lean.keys() == plain.keys() and len(plain) == 23  # 20 training losses, 3 evaluations
        assert max(abs(lean[key] - plain[key]) for key in plain) < 1e-6, mode
