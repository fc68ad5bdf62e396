# Paper 001, Table 3 No. 4 at CPU scale (configs/swat/owt_swat_base.py): Sliding, sigmoid, ALiBi-12:0, training window
# 16, training length 128, evaluation window 16 (the paper's 128 / 1024 / 128).
include("configs/swat/owt_swat_base.py")
out_dir = "out/owt_swat_04_sliding_sigmoid_alibi_12_0"
swat_activation = "sigmoid"
swat_rope = False
swat_slopes = "alibi"  # "the origin ALiBi model" (001 App. C.3): classic magnitudes 2^(-8k/12)
swat_split = "12:0"
swa_window = 16
block_size = 128
batch_size = 32
