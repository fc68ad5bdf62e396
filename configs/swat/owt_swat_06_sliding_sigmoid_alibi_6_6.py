# Paper 001, Table 3 No. 6 at CPU scale (configs/swat/owt_swat_base.py): Sliding, sigmoid, ALiBi-6:6, training window
# 16, training length 128, evaluation window 16 (the paper's 128 / 1024 / 128).
include("configs/swat/owt_swat_base.py")
out_dir = "out/owt_swat_06_sliding_sigmoid_alibi_6_6"
swat_activation = "sigmoid"
swat_rope = False
swat_slopes = "paper"
swat_split = "6:6"
swa_window = 16
block_size = 128
batch_size = 32
