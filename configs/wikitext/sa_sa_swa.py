# Paper 000 on WikiText-2 (configs/wikitext/wikitext_base.py): sa_swa (Table 1's LM columns).
include("configs/wikitext/wikitext_base.py")
out_dir = "out/wikitext_sa_sa_swa"
attn_pattern = "sa_swa"
attn_gate = True  # the recipe's output gate (sa_swa has one per path instead)
