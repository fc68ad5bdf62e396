# Paper 004 at CPU scale (configs/bridges/bridges_cpu_base.py): se_bridge.
include("configs/bridges/bridges_cpu_base.py")
out_dir = "out/bridges_cpu_se_bridge"
attn_pattern = "se_bridge"
