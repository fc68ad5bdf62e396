# Paper 004 at CPU scale (configs/bridges/bridges_cpu_base.py): bridge.
include("configs/bridges/bridges_cpu_base.py")
out_dir = "out/bridges_cpu_bridge"
attn_pattern = "bridge"
