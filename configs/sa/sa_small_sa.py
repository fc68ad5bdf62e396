# paper 000 at CPU scale (configs/sa/sa_small_base.py): sa.
include("configs/sa/sa_small_base.py")
out_dir = "out/sa_small_sa"
attn_pattern = "sa"
