# paper 000 at CPU scale (configs/sa/sa_small_base.py): full.
include("configs/sa/sa_small_base.py")
out_dir = "out/sa_small_full"
attn_pattern = "full"
