# Table 6 at CPU scale: MSWA with arithmetic group factors 1/2, 3/4, 1, 5/4.
include("configs/mswa/mswa_cpu_base.py")
out_dir = "out/mswa_cpu_arithmetic"
attn_pattern = "mswa"
mswa_variation = "arithmetic"
