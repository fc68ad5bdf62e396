# Paper 003, 7B (configs/swax/swax_7b_base.py): stochastic windows 128 (p = 0.75) / 2048, annealed over the last 10%.
include("configs/swax/swax_7b_base.py")
out_dir = "out/swax_7b_stochastic"
window_schedule = "stochastic"
