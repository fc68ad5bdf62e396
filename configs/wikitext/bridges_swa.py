# Paper 004 on WikiText-2 (configs/wikitext/wikitext_base.py): swa, b = w = 64, e = 32 (8 blocks per sequence).
include("configs/wikitext/wikitext_base.py")
out_dir = "out/wikitext_bridges_swa"
attn_pattern = "swa"
