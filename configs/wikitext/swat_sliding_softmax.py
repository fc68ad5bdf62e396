# Paper 001 on WikiText-2: sliding softmax attention, window 64 trained at T = 4w = 256 (Table 3 No. 3).
include("configs/wikitext/wikitext_base.py")
out_dir = "out/wikitext_swat_sliding_softmax"
attn_pattern = "swa"
block_size = 256
batch_size = 16
