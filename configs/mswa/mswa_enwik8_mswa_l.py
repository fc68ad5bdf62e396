# Paper 002, Table 2 (enwik8 bpc column): MSWA-l: layer windows 32..256.
include("configs/mswa/mswa_enwik8_base.py")
out_dir = "out/mswa_enwik8_mswa_l"
attn_pattern = "mswa_l"
