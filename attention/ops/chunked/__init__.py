"""The chunked kernel: block-sparse attention at the cost of a rule's edges, with autograd on any device (the CPU
training path). Query chunks attend the keys that hold their edges (tiles.py: a band of key chunks, or each
chunk's keys compacted), read and written a group of chunks per call (groups.py), through PyTorch's fused CPU
flash kernel, a sigmoid kernel with its own backward, or batched SDPA (op.py). Its reference is the dense one
(attention/ops/dense.py: dense_attention under the same rule)."""
