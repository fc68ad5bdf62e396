# Paper 003, 1.4B (configs/swax/swax_1p4b_base.py): the Transformer baseline, full causal attention (Table 1).
include("configs/swax/swax_1p4b_base.py")
out_dir = "out/swax_1p4b_transformer"
attn_pattern = "full"
