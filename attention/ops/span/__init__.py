"""Span attention: each query row attends one contiguous run of keys (attention/ops/span/spans.py derives the runs
from an edge rule): the Triton kernels (triton_kernels.py), their reference (naive.py) and the custom ops with
autograd (op.py)."""
