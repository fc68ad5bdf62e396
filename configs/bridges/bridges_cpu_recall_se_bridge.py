# Paper 004 retrieval at CPU scale (configs/bridges/bridges_cpu_recall_base.py): se_bridge.
include("configs/bridges/bridges_cpu_recall_base.py")
out_dir = "out/bridges_cpu_recall_se_bridge"
attn_pattern = "se_bridge"
