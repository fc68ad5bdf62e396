# paper 003 at CPU scale (configs/swax/swax_small_base.py): SWAX trained and tested with the short window.
include("configs/swax/swax_small_base.py")
out_dir = "out/swax_small_w16"
swa_window = 16
