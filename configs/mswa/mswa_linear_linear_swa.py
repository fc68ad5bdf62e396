# Table 3: linear,swa,swa
include("configs/mswa/mswa_linear_base.py")
out_dir = "out/mswa_linear_linear_swa"
attn_pattern = "linear,swa,swa"
