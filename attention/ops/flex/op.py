"""FlexAttention's call: inside a compiled block with the block mask planned outside it, else eagerly through one
compiled flex_attention at padded lengths that fails loudly past its recompile limit; the score_mod in flex's
form, and sigmoid attention from the softmax kernel's log-sum-exp."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from attention import simulate_cuda
from attention.edges import EdgeRule
from attention.ops.blocks import refuse_while_compiling
from attention.ops.flex.block_mask import FLEX_BLOCK, document_block_mask, flex_block_mask

FLEX_MIN_HEAD_DIM = 16  # torch 2.13's CUDA FlexAttention lowering needs head_dim >= 16

# eager calls (evaluation, generation's prefill) go through one compiled flex_attention; lengths are padded up
# to these buckets (multiples of FLEX_BLOCK, two per octave) so that a grid of lengths or the varying widths
# of ranking batches compile a bounded number of kernels
FLEX_RECOMPILE_LIMIT = 64  # distinct (rule, bucket, batch, dtype) kernels before it fails (never a silent fallback)
# None: on CUDA (and on the CPU standing in for it, compiled with aot_eager); eager on the CPU otherwise, where
# flex checks masks in the tests, forward only
COMPILE_EAGER_FLEX = None


def flex_length_bucket(n: int) -> int:
    """The padded length of an eager flex call: the smallest of 128, 256, 384, 512, 768, 1024, 1536, ... >= n
    (powers of two and, from 384 on, 3/4 of them: at most a third of a call is padding)."""
    size = FLEX_BLOCK
    while size < n:
        size *= 2
    return size * 3 // 4 if size >= 4 * FLEX_BLOCK and n <= size * 3 // 4 else size


@functools.cache
def _compiled_flex(backend: str = "inductor"):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False, backend=backend)


def flex(q, k, v, rule: EdgeRule, start: int = 0, score_mod=None, activation="softmax", dropout_p: float = 0.0,
         block_mask=None, docs=None, key_docs=None):
    """FlexAttention under the rule's block mask, narrowed to the documents of a batch when docs (B, n) of the
    queries are given (and key_docs of the keys, where they are in another order: document_block_mask). Sigmoid
    attention is computed by the softmax kernel: with scores replaced by log sigmoid(s), softmax gives sigmoid(s_j)
    / sum_k sigmoid(s_k), and the row's log-sum-exp is log sum_k sigmoid(s_k), so out * exp(lse) = sum_j
    sigmoid(s_j) v_j (rows without keys: 0).

    Inside a compiled block (training) flex_attention joins the block's graph, with the block mask and the
    score_mod planned outside it (plan_attention: score_mod already in flex's form). Called eagerly, it runs
    one compiled flex_attention, with the sequence padded to flex_length_bucket, and fails loudly rather than
    falling back to eager flex (which materialises (B, H, n, n) scores) if the kernels it compiled exceed
    FLEX_RECOMPILE_LIMIT."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    if activation not in ("softmax", "sigmoid"):
        raise ValueError(f"unknown attention activation {activation!r}: expected softmax or sigmoid")
    if dropout_p > 0:
        raise ValueError("the flex backend has no attention dropout: set dropout=0 or use attn_backend=chunked")
    on_cuda = simulate_cuda.gpu_path(q.device)  # CUDA, or the CPU standing in for it
    if on_cuda and q.shape[-1] < FLEX_MIN_HEAD_DIM:
        raise ValueError(f"FlexAttention on CUDA needs a head dimension of at least {FLEX_MIN_HEAD_DIM} (got "
                         f"{q.shape[-1]}): use attn_backend=chunked, or fewer, wider heads")
    if not on_cuda and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError("FlexAttention has no CPU backward in this torch version: train on CPU with "
                           "attn_backend=chunked (or auto)")
    if simulate_cuda.simulated(q.device) and not torch.compiler.is_compiling():
        simulate_cuda.allow_flex_cpu_backward()
    kwargs = {"enable_gqa": k.shape[1] != q.shape[1]}  # grouped-query: k, v heads shared, not repeated
    if activation == "sigmoid":
        kwargs["return_aux"] = AuxRequest(lse=True)
    finish = (lambda out: out) if activation == "softmax" else (lambda out: _sigmoid_output(*out, q.dtype))
    if torch.compiler.is_compiling():
        if block_mask is None:
            refuse_while_compiling("the flex block mask")
        return finish(flex_attention(q, k, v, score_mod=score_mod, block_mask=narrowed(block_mask, docs, key_docs),
                                     **kwargs))
    if block_mask is None:  # not planned (a direct call): the score_mod in flex's form, as plan_attention makes it
        score_mod = flex_score_mod(score_mod, start, activation)
    n, H, device = q.shape[2], q.shape[1], str(q.device)
    if not (on_cuda if COMPILE_EAGER_FLEX is None else COMPILE_EAGER_FLEX):  # eager flex: CPU mask checks
        block_mask = block_mask if block_mask is not None else flex_block_mask(rule, n, H, device, start)
        return finish(flex_attention(q, k, v, score_mod=score_mod, block_mask=narrowed(block_mask, docs, key_docs),
                                     **kwargs))
    # a permutation's band, and keys with a prefix of copies, are planned at their own length
    padded = flex_length_bucket(n) if rule.static and rule.key_count(n) == n else n
    if padded != n:
        block_mask = flex_block_mask(rule, padded, H, device, start, valid=n)
        q, k, v = (F.pad(t, (0, 0, 0, padded - n)) for t in (q, k, v))
        if docs is not None:  # padding is a document of its own, which no real row shares
            docs, key_docs = (None if d is None else F.pad(d, (0, padded - n), value=-1) for d in (docs, key_docs))
    elif block_mask is None:
        block_mask = flex_block_mask(rule, n, H, device, start)
    # the default stance even where the caller runs eagerly (train.py's probes run under force_eager so that the
    # compiled blocks do not recompile for every probe length): force_eager would run flex_attention eagerly too,
    # materialising (B, H, n, n) scores
    with torch._dynamo.config.patch(recompile_limit=FLEX_RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True), \
            torch.compiler.set_stance("default"):
        try:
            out = _compiled_flex(simulate_cuda.compile_backend(q.device))(
                q, k, v, score_mod=score_mod, block_mask=narrowed(block_mask, docs, key_docs), **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            raise RuntimeError(f"compiled FlexAttention has built {FLEX_RECOMPILE_LIMIT} kernels (one per rule, padded "
                               "length, batch size and dtype) and would now fall back to materialising (B, H, n, n) "
                               "scores: evaluate fewer lengths, batch sizes or windows per process, or raise "
                               "attention.ops.flex.op.FLEX_RECOMPILE_LIMIT") from None
    return finish(out)[:, :, :n]


def narrowed(block_mask, docs, key_docs):
    """The block mask narrowed to a batch's documents (document_block_mask), or as it is without them."""
    return block_mask if docs is None else document_block_mask(block_mask, docs, key_docs)


def _sigmoid_output(out, aux, dtype):
    compute = torch.promote_types(dtype, torch.float32)  # float64 inputs keep their precision
    return (out.to(compute) * aux.lse.to(compute).exp()[..., None]).to(dtype)


@functools.lru_cache(maxsize=64)
def flex_score_mod(score_mod, start, activation):
    """The score_mod handed to FlexAttention, one object per (score_mod, start, activation): compiled flex
    recompiles for a new function object."""
    mod = score_mod
    if mod is not None and start:
        mod = lambda s, b, h, qi, ki: score_mod(s, b, h, qi + start, ki + start)
    if activation == "sigmoid":
        inner = mod
        mod = lambda s, b, h, qi, ki: _log_sigmoid(s if inner is None else inner(s, b, h, qi, ki))
    return mod


def _log_sigmoid(x):
    """log(sigmoid(x)) from pointwise ops. Not F.logsigmoid: its op (log_sigmoid_forward) returns an empty buffer
    on CUDA, which FlexAttention's eager form (vmap over the score_mod: aot_eager, uncompiled calls) cannot
    batch ("SmallVector unable to grow" on an H200, torch 2.11)."""
    return x.clamp(max=0) - torch.log1p(torch.exp(-x.abs()))
