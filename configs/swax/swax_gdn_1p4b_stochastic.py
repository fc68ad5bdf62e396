# Paper 003, Sec. 4.5: SWAX/GDN, Gated DeltaNet in place of the mLSTM, same training as configs/swax/swax_1p4b_stochastic.py.
include("configs/swax/swax_1p4b_stochastic.py")
out_dir = "out/swax_gdn_1p4b_stochastic"
attn_pattern = "swax_gdn"  # swa, gated_deltanet, ...
