# Paper 001, Table 3 No. 5 at CPU scale (configs/swat/owt_swat_base.py): Sliding, sigmoid, ALiBi-8:4, training window
# 16, training length 128, evaluation window 16 (the paper's 128 / 1024 / 128).
include("configs/swat/owt_swat_base.py")
out_dir = "out/owt_swat_05_sliding_sigmoid_alibi_8_4"
swat_activation = "sigmoid"
swat_rope = False
swat_slopes = "paper"
swat_split = "8:4"
swa_window = 16
block_size = 128
batch_size = 32
