# Table 5: base window 64 (compare with SWA at the same window: --attn_pattern=swa).
include("configs/mswa/mswa_wt103_base.py")
out_dir = "out/mswa_wt103_w64"
attn_pattern = "mswa"
swa_window = 64
