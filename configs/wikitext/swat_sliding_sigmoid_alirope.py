# Paper 001 on WikiText-2: SWAT's AliRope (balanced ALiBi 2:2 and RoPE), w = 64, T = 256 (No. 8).
include("configs/wikitext/wikitext_base.py")
out_dir = "out/wikitext_swat_sliding_sigmoid_alirope"
attn_pattern = "swat"
swat_activation = "sigmoid"
swat_rope = True
swat_slopes = "paper"
swat_split = "2:2"
block_size = 256
batch_size = 16
