"""MoBA (Lu et al. 2025): the block choice and attention over the chosen blocks, as Triton kernels
(triton_kernels.py) beside their reference (naive.py: also MoBA's edge, chosen_block_edges, and moba_dense, the
dense backend), wrapped as custom ops with autograd (op.py); and blockwise.py, the PyTorch kernel that runs where
they do not (the CPU, decoding over a cache, attention dropout)."""
