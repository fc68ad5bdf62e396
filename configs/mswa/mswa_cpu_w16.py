# Table 5 at CPU scale: MSWA with base window 16 (SWA at the same window: --attn_pattern=swa).
include("configs/mswa/mswa_cpu_base.py")
out_dir = "out/mswa_cpu_w16"
attn_pattern = "mswa"
swa_window = 16
