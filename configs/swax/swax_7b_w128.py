# Paper 003, 7B (configs/swax/swax_7b_base.py): SWAX with a fixed window of 128 (Fig. 8).
include("configs/swax/swax_7b_base.py")
out_dir = "out/swax_7b_w128"
swa_window = 128
