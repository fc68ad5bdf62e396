# Table 3: mswa
include("configs/mswa/mswa_linear_base.py")
out_dir = "out/mswa_linear_mswa"
attn_pattern = "mswa"
