# Paper 004 retrieval at CPU scale (configs/bridges/bridges_cpu_recall_base.py): full.
include("configs/bridges/bridges_cpu_recall_base.py")
out_dir = "out/bridges_cpu_recall_full"
attn_pattern = "full"
