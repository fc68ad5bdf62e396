# Paper 003, 1.4B (configs/swax/swax_1p4b_base.py): the pure xLSTM baseline (every layer mLSTM, Table 1).
include("configs/swax/swax_1p4b_base.py")
out_dir = "out/swax_1p4b_xlstm"
attn_pattern = "mlstm"
