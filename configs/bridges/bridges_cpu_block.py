# Paper 004 at CPU scale (configs/bridges/bridges_cpu_base.py): block.
include("configs/bridges/bridges_cpu_base.py")
out_dir = "out/bridges_cpu_block"
attn_pattern = "block"
