# Table 3: linear,mswa,mswa
include("configs/mswa/mswa_linear_base.py")
out_dir = "out/mswa_linear_linear_mswa"
attn_pattern = "linear,mswa,mswa"
