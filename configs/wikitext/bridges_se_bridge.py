# Paper 004 on WikiText-2 (configs/wikitext/wikitext_base.py): se_bridge, b = w = 64, e = 32 (8 blocks per sequence).
include("configs/wikitext/wikitext_base.py")
out_dir = "out/wikitext_bridges_se_bridge"
attn_pattern = "se_bridge"
