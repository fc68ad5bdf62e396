# Paper 001, Table 3 No. 1 at CPU scale (configs/swat/owt_swat_base.py): Vanilla, softmax, RoPE, training window
# 16, training length 16, evaluation window 16 (the paper's 128 / 128 / 128).
include("configs/swat/owt_swat_base.py")
out_dir = "out/owt_swat_01_vanilla_softmax_rope"
swat_activation = "softmax"
swat_rope = True
swat_slopes = "none"
swa_window = 16
block_size = 16
batch_size = 256
