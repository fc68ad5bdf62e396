# Paper 004 at CPU scale (configs/bridges/bridges_cpu_base.py): swa.
include("configs/bridges/bridges_cpu_base.py")
out_dir = "out/bridges_cpu_swa"
attn_pattern = "swa"
