# Paper 002, Table 2 (enwik8 bpc column): MSWA-h: head windows 32..256 in every layer.
include("configs/mswa/mswa_enwik8_base.py")
out_dir = "out/mswa_enwik8_mswa_h"
attn_pattern = "mswa_h"
