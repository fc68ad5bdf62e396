"""Attention kernels written for this project, one algorithm per package (flash-linear-attention's layout): its
Triton kernels beside a naive reference that the tests hold them to, under Triton's interpreter on the CPU.

    span    each query attends one contiguous run of keys (per head), optionally causal in a second order:
            swa, mswa, block, swat (sigmoid, ALiBi), paper 004's bridges, stochastic attention's band
    moba    each query attends its own block causally and the other blocks it chose (MoBA)
"""
