# Table 5 at CPU scale: MSWA with base window 64 (SWA at the same window: --attn_pattern=swa).
include("configs/mswa/mswa_cpu_base.py")
out_dir = "out/mswa_cpu_w64"
attn_pattern = "mswa"
swa_window = 64
# its deepest heads have window 2 x 2 x 64 = 256: train at 512 (8 sequences, the same 4,096 tokens per step) so
# that no head is full attention in training
block_size = 512
batch_size = 8
