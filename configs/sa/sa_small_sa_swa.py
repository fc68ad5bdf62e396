# paper 000 at CPU scale (configs/sa/sa_small_base.py): sa_swa.
include("configs/sa/sa_small_base.py")
out_dir = "out/sa_small_sa_swa"
attn_pattern = "sa_swa"
