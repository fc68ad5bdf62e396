"""Attention kernels written for this project, one algorithm per module or package (flash-linear-attention's
layout): each beside the reference the tests hold it to, the Triton kernels under Triton's interpreter on the
CPU. Every kernel that runs an edge rule implements the contract of contract.py (can it run a call, should auto
pick it, its typed plan, run, the scores it computes); attention/kernels.py registers them in one place, plans
by asking the registry and dispatches to the plan's kernel. MoBA's layer and the recurrent mixers' layers
(attention/moba.py, mlstm.py, gated_deltanet.py, linear.py) call theirs directly.

    contract.py  the kernel contract: AttentionCall, AttentionPlan, Kernel, KernelRefused
    heads.py     groups of heads a kernel runs apart, each at its own cost and in its layout (chunked, flex)
    dense.py     the reference: explicit scores under a rule's mask, any device (every kernel's naive form); the
                 dense and sdpa kernels
    score_mod.py the score_mod every kernel takes, and ScoreBias, the additive kind the fused paths take
    blocks.py    a rule's block structure (the key blocks holding each query block's edges), which the chunked
                 tiles and FlexAttention's block masks are built from
    chunked      block-sparse attention over query chunks with autograd on any device (the CPU training path):
                 tiles.py, groups.py, op.py, kernel.py
    window.py    rules made of disjoint windows (paper 004's bridge path): one batched SDPA call over their tiles
    flex         FlexAttention under a rule's block mask, compiled on CUDA: block_mask.py, op.py, kernel.py
    span         each query attends one contiguous run of keys (per head), optionally causal in a second order:
                 swa, mswa, block, swat (sigmoid, ALiBi), paper 004's bridges, stochastic attention's band
                 (Triton, naive.py beside it; kernel.py)
    moba         each query attends its own block causally and the other blocks it chose (MoBA; Triton,
                 naive.py beside it, and blockwise.py, the PyTorch path off CUDA)
    mlstm        xLSTM 7B's mLSTM cell: chunkwise.py (training), recurrent.py (generation), naive.py (quadratic,
                 the reference), mlstm_kernels' Triton kernel as custom ops (op.py)
    gated_deltanet
                 the gated delta rule: chunk.py (the WY form), naive.py (recurrent: the reference and generation),
                 fla's Triton kernel and its CPU stand-in (fla_kernel.py), the short convolution (conv.py)
    linear       Taylor linear attention (paper 002): feature_map.py, chunk.py (training), recurrent.py
                 (generation), naive.py (quadratic, the reference)
"""
