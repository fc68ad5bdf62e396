# Paper 002 on WikiText-2: Table 3's linear,mswa,mswa (6 layers: two [linear, local, local] stacks).
include("configs/wikitext/wikitext_base.py")
out_dir = "out/wikitext_mswa_linear_mswa"
attn_pattern = "linear,mswa,mswa"
n_layer = 6
