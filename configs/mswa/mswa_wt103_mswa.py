include("configs/mswa/mswa_wt103_base.py")
out_dir = "out/mswa_wt103_mswa"
attn_pattern = "mswa"
