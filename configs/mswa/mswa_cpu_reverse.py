# Table 6 at CPU scale: MSWA with windows decreasing with depth.
include("configs/mswa/mswa_cpu_base.py")
out_dir = "out/mswa_cpu_reverse"
attn_pattern = "mswa"
mswa_layer_order = "reverse"
