# paper 003 at CPU scale (configs/swax/swax_small_base.py): SWAX trained with the long window only.
include("configs/swax/swax_small_base.py")
out_dir = "out/swax_small_w128"
swa_window = 128
