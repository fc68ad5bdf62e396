# Paper 003, 7B (configs/swax/swax_7b_base.py): SWAX with a fixed window of 2048 (Fig. 8).
include("configs/swax/swax_7b_base.py")
out_dir = "out/swax_7b_w2048"
swa_window = 2048
