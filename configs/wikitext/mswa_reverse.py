# Paper 002 on WikiText-2: MSWA, Table 6's reverse ablation.
include("configs/wikitext/wikitext_base.py")
out_dir = "out/wikitext_mswa_reverse"
attn_pattern = "mswa"
mswa_layer_order = "reverse"
