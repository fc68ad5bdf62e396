# Paper 002's Table 3 (App. B.2.1, "Combination with Linear Attention"): the Table 2 recipe with Taylor
# feature dim 16, sequences of 2,048 tokens and batch 8; base window 128.
# configs/mswa/mswa_linear_*.py include this file and pick the layer pattern.
include("configs/mswa/mswa_wt103_base.py")
out_dir = "out/mswa_linear"
attn_pattern = "full"
linear_feature_dim = 16
block_size = 2048
batch_size = 8
# memory (python -m scripts.plan_memory configs/mswa/mswa_linear_linear.py --world_size=1): one 80 GB GPU, batch 8 x
# accumulation 1 (16,384 tokens per step), no activation checkpointing: at most about 20 GiB (linear); on N
# GPUs --batch_size=8/N --gradient_accumulation_steps=N
