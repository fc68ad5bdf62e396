# Paper 004 at CPU scale (configs/bridges/bridges_cpu_base.py): full.
include("configs/bridges/bridges_cpu_base.py")
out_dir = "out/bridges_cpu_full"
attn_pattern = "full"
