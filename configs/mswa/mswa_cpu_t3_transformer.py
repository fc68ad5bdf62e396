# Table 3 at CPU scale: full (6 layers: two [linear, local, local] stacks; 4 local layers for MSWA)
include("configs/mswa/mswa_cpu_base.py")
out_dir = "out/mswa_cpu_t3_transformer"
n_layer = 6
attn_pattern = "full"
