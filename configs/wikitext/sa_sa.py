# Paper 000 on WikiText-2 (configs/wikitext/wikitext_base.py): sa (Table 1's LM columns).
include("configs/wikitext/wikitext_base.py")
out_dir = "out/wikitext_sa_sa"
attn_pattern = "sa"
attn_gate = True  # the recipe's output gate (sa_swa has one per path instead)
