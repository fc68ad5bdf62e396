# Paper 002, Table 2 (enwik8 bpc column): SWA, window 128.
include("configs/mswa/mswa_enwik8_base.py")
out_dir = "out/mswa_enwik8_swa"
attn_pattern = "swa"
