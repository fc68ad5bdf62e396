# Paper 001, Table 3 No. 10 at CPU scale (configs/swat/owt_swat_base.py): Vanilla, softmax, RoPE, training window
# 128, training length 128, evaluation window 128 (the paper's 1024 / 1024 / 1024).
include("configs/swat/owt_swat_base.py")
out_dir = "out/owt_swat_10_vanilla_softmax_rope_w128"
swat_activation = "softmax"
swat_rope = True
swat_slopes = "none"
swa_window = 128
block_size = 128
batch_size = 32
