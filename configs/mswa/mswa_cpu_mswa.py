# Table 2 at CPU scale: MSWA, both (Table 1 schedule).
include("configs/mswa/mswa_cpu_base.py")
out_dir = "out/mswa_cpu_mswa"
attn_pattern = "mswa"
