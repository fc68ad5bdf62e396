# Table 2 at CPU scale: MSWA-h, heads in 4 groups w/4, w/2, w, 2w in every layer.
include("configs/mswa/mswa_cpu_base.py")
out_dir = "out/mswa_cpu_mswa_h"
attn_pattern = "mswa_h"
