# Table 2 at CPU scale: MSWA-l, layers in 4 depth groups w/4, w/2, w, 2w.
include("configs/mswa/mswa_cpu_base.py")
out_dir = "out/mswa_cpu_mswa_l"
attn_pattern = "mswa_l"
