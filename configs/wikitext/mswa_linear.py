# Paper 002 on WikiText-2: Table 3's linear (6 layers: two [linear, local, local] stacks).
include("configs/wikitext/wikitext_base.py")
out_dir = "out/wikitext_mswa_linear"
attn_pattern = "linear"
n_layer = 6
