# Table 6: windows decreasing with depth.
include("configs/mswa/mswa_wt103_base.py")
out_dir = "out/mswa_wt103_reverse"
attn_pattern = "mswa"
mswa_layer_order = "reverse"
