# Table 2 at CPU scale: SWA with the base window of the MSWA runs (w = 32).
include("configs/mswa/mswa_cpu_base.py")
out_dir = "out/mswa_cpu_swa"
attn_pattern = "swa"
