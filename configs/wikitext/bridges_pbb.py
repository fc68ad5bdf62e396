# Paper 004 on WikiText-2 (configs/wikitext/wikitext_base.py): pbb, b = w = 64, e = 32 (8 blocks per sequence).
include("configs/wikitext/wikitext_base.py")
out_dir = "out/wikitext_bridges_pbb"
attn_pattern = "pbb"
