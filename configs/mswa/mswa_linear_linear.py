# Table 3: linear
include("configs/mswa/mswa_linear_base.py")
out_dir = "out/mswa_linear_linear"
attn_pattern = "linear"
