# Paper 001, Table 3 No. 3 at CPU scale (configs/swat/owt_swat_base.py): Sliding, softmax, RoPE, training window
# 16, training length 128, evaluation window 16 (the paper's 128 / 1024 / 128).
include("configs/swat/owt_swat_base.py")
out_dir = "out/owt_swat_03_sliding_softmax_rope"
swat_activation = "softmax"
swat_rope = True
swat_slopes = "none"
swa_window = 16
block_size = 128
batch_size = 32
