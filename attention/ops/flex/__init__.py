"""FlexAttention under a rule: block masks built once per (rule, length) from the rule's block structure and shared
by all layers (block_mask.py), and the call, compiled on CUDA, with sigmoid attention from the softmax kernel
(op.py). Its reference is the dense one (attention/ops/dense.py)."""
