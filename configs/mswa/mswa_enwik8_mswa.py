# Paper 002, Table 2 (enwik8 bpc column): MSWA: windows 8..512 over heads and layers.
include("configs/mswa/mswa_enwik8_base.py")
out_dir = "out/mswa_enwik8_mswa"
attn_pattern = "mswa"
