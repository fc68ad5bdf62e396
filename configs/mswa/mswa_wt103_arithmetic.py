# Table 6: arithmetic group factors (64, 96, 128, 160 for base 128).
include("configs/mswa/mswa_wt103_base.py")
out_dir = "out/mswa_wt103_arithmetic"
attn_pattern = "mswa"
mswa_variation = "arithmetic"
