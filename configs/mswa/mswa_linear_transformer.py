# Table 3: full
include("configs/mswa/mswa_linear_base.py")
out_dir = "out/mswa_linear_transformer"
attn_pattern = "full"
