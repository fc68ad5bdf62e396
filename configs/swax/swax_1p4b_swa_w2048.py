# Paper 003, 1.4B (configs/swax/swax_1p4b_base.py): the pure SWA baseline, window 2048 (Table 1, App. A Fig. 9).
include("configs/swax/swax_1p4b_base.py")
out_dir = "out/swax_1p4b_swa_w2048"
attn_pattern = "swa"
swa_window = 2048
