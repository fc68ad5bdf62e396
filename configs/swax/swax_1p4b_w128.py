# Paper 003, 1.4B (configs/swax/swax_1p4b_base.py): SWAX trained and tested with a fixed window of 128 (Table 1, Fig. 5).
include("configs/swax/swax_1p4b_base.py")
out_dir = "out/swax_1p4b_w128"
swa_window = 128
