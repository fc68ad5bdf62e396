# paper 000 at CPU scale (configs/sa/sa_small_base.py): swa.
include("configs/sa/sa_small_base.py")
out_dir = "out/sa_small_swa"
attn_pattern = "swa"
