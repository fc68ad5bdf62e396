"""MoBA (attention/moba.py): the block choice against a direct reading of its definition, the blockwise kernel
against the dense reference forward and backward, O(n c k) memory, and the layer in a model."""

import pytest
import torch

from attention import validate_config
from attention.ops.moba.blockwise import moba_blockwise
from attention.ops.moba.naive import moba_choose, moba_dense
from config import ModelConfig
from helpers import LargestTensor, fwd_bwd, qkv, tiny


def chosen_by_definition(q, k, t, block, topk):
    """One query's blocks, read off the definition: its own block, then the earlier blocks by q . mean(k)."""
    own = t // block
    earlier = sorted(range(own), key=lambda j: -float(q[t] @ k[j * block:(j + 1) * block].mean(0)))
    return {own, *earlier[:topk - 1]}


@pytest.mark.parametrize("n, block, topk", [(64, 8, 2), (70, 8, 3), (33, 16, 4)])
def test_each_query_chooses_its_own_block_and_the_best_earlier_ones(n, block, topk):
    q, k = (t.detach() for t in qkv(n)[:2])
    chosen = moba_choose(q, k, torch.arange(n), block, topk)
    for b, h, t in [(0, 0, n - 1), (1, 3, n // 2), (0, 2, block - 1), (1, 1, block)]:
        row = chosen[b, h, t].tolist()
        assert {j for j in row if j >= 0} == chosen_by_definition(q[b, h], k[b, h], t, block, topk)
        assert row[0] == t // block  # the own block first, always
        assert row.count(-1) == max(0, topk - (t // block + 1))


@pytest.mark.parametrize("n, block, topk", [(64, 8, 2), (70, 8, 3), (33, 16, 4), (5, 8, 2)])
def test_blockwise_kernel_equals_dense_reference_forward_and_backward(n, block, topk):
    tensors = qkv(n)
    chosen = moba_choose(*tensors[:2], torch.arange(n), block, topk)
    reference = fwd_bwd(lambda q, k, v: moba_dense(q, k, v, torch.arange(n), chosen, block), tensors)
    gathered = fwd_bwd(lambda q, k, v: moba_blockwise(q, k, v, torch.arange(n), chosen, block), tensors)
    for a, b in zip([reference[0], *reference[1]], [gathered[0], *gathered[1]]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("n_keys, n_queries", [(70, 70), (70, 9), (33, 1)])
def test_blockwise_kernel_over_a_cache_and_with_dropout_equals_dense_reference(n_keys, n_queries):
    """Queries at the end of a longer key sequence (a prompt continued over a cache: every chosen block,
    the own one too, through the grouped path and its causal mask), and the dropout path's autograd at p = 0."""
    from attention.ops.moba.blockwise import _moba_blockwise

    q, k, v = qkv(n_keys)
    q = q[:, :, -n_queries:].detach().requires_grad_()
    pos = torch.arange(n_keys - n_queries, n_keys)
    chosen = moba_choose(q, k, pos, 8, 3)
    reference = fwd_bwd(lambda q, k, v: moba_dense(q, k, v, pos, chosen, 8), (q, k, v))
    for kernel in (moba_blockwise, lambda *args: _moba_blockwise(*args, dropout_p=0.0)):
        got = fwd_bwd(lambda q, k, v: kernel(q, k, v, pos, chosen, 8), (q, k, v))
        for a, b in zip([reference[0], *reference[1]], [got[0], *got[1]]):
            torch.testing.assert_close(a, b)
    torch.manual_seed(0)
    dropped = moba_blockwise(q, k, v, pos, chosen, 8, dropout_p=0.5)
    torch.manual_seed(0)
    assert torch.equal(dropped, moba_blockwise(q, k, v, pos, chosen, 8, dropout_p=0.5))
    assert not torch.allclose(dropped, reference[0])
    dropped.sum().backward()


def test_enough_blocks_is_full_attention():
    from attention.edges import Causal
    from attention.kernels import attend

    q, k, v = qkv(40)
    chosen = moba_choose(q, k, torch.arange(40), 8, 5)  # 5 blocks of 8: every query takes every earlier block
    torch.testing.assert_close(moba_blockwise(q, k, v, torch.arange(40), chosen, 8), attend(q, k, v, Causal(), "dense"))


def test_blockwise_kernel_never_builds_an_n_by_n_tensor_nor_a_copy_of_the_keys_per_query():
    n, block, topk, dim = 8192, 64, 2, 8
    q, k, v = (torch.randn(1, 2, n, dim, requires_grad=True) for _ in range(3))
    with LargestTensor() as largest:
        chosen = moba_choose(q, k, torch.arange(n), block, topk)
        moba_blockwise(q, k, v, torch.arange(n), chosen, block).sum().backward()
    # the block scores (n x n / c) and the pairs' partial outputs (n k D) are the largest, per head
    assert largest.numel <= 2 * n * max(n // block, topk * dim), largest.shape
    assert largest.numel < 2 * n * topk * block * dim // 4  # far below the per-query copies of the keys


def test_moba_in_a_model_is_causal_trains_and_generates_from_its_cache():
    model = tiny("llama", "moba,full", moba_block=8, moba_topk=2)
    idx = torch.randint(0, 61, (2, 50))
    changed = idx.clone()
    changed[:, 31:] = torch.randint(0, 61, (2, 19))
    torch.testing.assert_close(model(idx)[0][:, :31], model(changed)[0][:, :31])
    logits, loss = model.train()(idx, targets=idx)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.eval()
    prompt = torch.randint(0, 61, (2, 20))
    assert torch.equal(model.generate(prompt, 20, temperature=0, use_cache=True),
                       model.generate(prompt, 20, temperature=0, use_cache=False))


def test_dense_backend_is_the_reference_through_a_model():
    idx = torch.randint(0, 61, (2, 50))
    dense = tiny("gpt2", "moba", moba_block=8, moba_topk=3, attn_backend="dense")(idx)[0]
    torch.testing.assert_close(tiny("gpt2", "moba", moba_block=8, moba_topk=3)(idx)[0], dense)


@pytest.mark.parametrize("bad, message", [({"moba_block": 0}, "moba_block=0"), ({"moba_topk": 0}, "moba_topk=0"),
                                          ({"attn_gate": True}, "without it")])
def test_bad_settings_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        validate_config(ModelConfig(n_layer=2, n_head=2, n_embd=16, attn_pattern="moba", **bad))


def test_moba_declares_the_attention_settings_it_reads():
    # compare.py tells runs apart by the settings their layers declare: two moba runs differing in n_kv_head
    # must not be averaged as seeds of one configuration
    from attention.registry import used_settings
    from config import ModelConfig

    used = used_settings(ModelConfig(attn_pattern="moba"))
    assert {"n_kv_head", "attn_head_dim", "qk_norm", "qkv_bias", "moba_block", "moba_topk"} <= used
