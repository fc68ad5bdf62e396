# Paper 002 on WikiText-2 (configs/wikitext/wikitext_base.py): mswa_h with base window 64 (Table 2's rows).
include("configs/wikitext/wikitext_base.py")
out_dir = "out/wikitext_mswa_mswa_h"
attn_pattern = "mswa_h"
