"""Attention kernels written for this project, one algorithm per module or package (flash-linear-attention's
layout): each beside the reference the tests hold it to, the Triton kernels under Triton's interpreter on the
CPU. attention/kernels.py plans which one runs a rule and dispatches to it.

    dense.py     the reference: explicit scores under a rule's mask, any device (every kernel's naive form)
    score_mod.py the score_mod every kernel takes, and ScoreBias, the additive kind the fused paths take
    blocks.py    a rule's block structure (the key blocks holding each query block's edges), which the chunked
                 tiles and FlexAttention's block masks are built from
    chunked      block-sparse attention over query chunks with autograd on any device (the CPU training path):
                 tiles.py, groups.py, op.py
    window.py    rules made of disjoint windows (paper 004's bridge path): one batched SDPA call over their tiles
    flex         FlexAttention under a rule's block mask, compiled on CUDA: block_mask.py, op.py
    span         each query attends one contiguous run of keys (per head), optionally causal in a second order:
                 swa, mswa, block, swat (sigmoid, ALiBi), paper 004's bridges, stochastic attention's band
                 (Triton, naive.py beside it)
    moba         each query attends its own block causally and the other blocks it chose (MoBA; Triton,
                 naive.py beside it)
"""
