# Table 5: base window 256 (compare with SWA at the same window: --attn_pattern=swa).
include("configs/mswa/mswa_wt103_base.py")
out_dir = "out/mswa_wt103_w256"
attn_pattern = "mswa"
swa_window = 256
# the deepest heads' window is 4 x 256 = 1024, at least the base's 1,024-token segments: train at 4,096 (4
# sequences, the same 16,384 tokens per step) so that no head is full attention in training. (The paper's
# Transformer-XL memory lets attention reach past its segment; without it the segment must hold the window.)
block_size = 4096
batch_size = 4
