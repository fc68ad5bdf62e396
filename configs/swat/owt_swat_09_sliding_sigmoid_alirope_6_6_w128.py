# Paper 001, Table 3 No. 9 at CPU scale (configs/swat/owt_swat_base.py): Sliding, sigmoid, AliRope-6:6, training window
# 128, training length 128, evaluation window 128 (the paper's 1024 / 1024 / 1024).
include("configs/swat/owt_swat_base.py")
out_dir = "out/owt_swat_09_sliding_sigmoid_alirope_6_6_w128"
swat_activation = "sigmoid"
swat_rope = True
swat_slopes = "paper"
swat_split = "6:6"
swa_window = 128
block_size = 128
batch_size = 32
