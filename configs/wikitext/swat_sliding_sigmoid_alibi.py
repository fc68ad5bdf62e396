# Paper 001 on WikiText-2: sliding sigmoid attention with balanced ALiBi 2:2 (Eq. 4), w = 64, T = 256 (No. 6).
include("configs/wikitext/wikitext_base.py")
out_dir = "out/wikitext_swat_sliding_sigmoid_alibi"
attn_pattern = "swat"
swat_activation = "sigmoid"
swat_rope = False
swat_slopes = "paper"
swat_split = "2:2"
block_size = 256
batch_size = 16
