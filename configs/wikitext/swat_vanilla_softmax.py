# Paper 001 on WikiText-2 (configs/wikitext/wikitext_base.py): vanilla softmax attention trained with window =
# length (Table 3 No. 1's layout: T = w = 64), evaluated at 1x-16x T (Table 2).
include("configs/wikitext/wikitext_base.py")
out_dir = "out/wikitext_swat_vanilla_softmax"
attn_pattern = "swa"
block_size = 64
batch_size = 64  # the same 32,768 tokens per step as the T = 512 rows
