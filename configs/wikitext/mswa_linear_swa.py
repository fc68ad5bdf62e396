# Paper 002 on WikiText-2: Table 3's linear,swa,swa (6 layers: two [linear, local, local] stacks).
include("configs/wikitext/wikitext_base.py")
out_dir = "out/wikitext_mswa_linear_swa"
attn_pattern = "linear,swa,swa"
n_layer = 6
