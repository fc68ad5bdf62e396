"""MoBA (Lu et al. 2025): the block choice and attention over the chosen blocks, as Triton kernels
(triton_kernels.py) beside their reference (naive.py), wrapped as custom ops with autograd (op.py)."""
