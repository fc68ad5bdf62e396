# Paper 001, Table 3 No. 11 at CPU scale (configs/swat/owt_swat_base.py): Vanilla, sigmoid, ALiBi-12:0, training window
# 128, training length 128, evaluation window 128 (the paper's 1024 / 1024 / 1024).
include("configs/swat/owt_swat_base.py")
out_dir = "out/owt_swat_11_vanilla_sigmoid_alibi_w128"
swat_activation = "sigmoid"
swat_rope = False
swat_slopes = "alibi"  # "the origin ALiBi model" (001 App. C.3): classic magnitudes 2^(-8k/12)
swat_split = "12:0"
swa_window = 128
block_size = 128
batch_size = 32
