# Paper 002 on WikiText-2: MSWA, Table 6's arithmetic ablation.
include("configs/wikitext/wikitext_base.py")
out_dir = "out/wikitext_mswa_arithmetic"
attn_pattern = "mswa"
mswa_variation = "arithmetic"
