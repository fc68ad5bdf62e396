# Paper 004 at CPU scale (configs/bridges/bridges_cpu_base.py): pbb.
include("configs/bridges/bridges_cpu_base.py")
out_dir = "out/bridges_cpu_pbb"
attn_pattern = "pbb"
