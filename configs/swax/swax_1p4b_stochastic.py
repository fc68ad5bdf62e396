# Paper 003, 1.4B (configs/swax/swax_1p4b_base.py): stochastic window training (Sec. 4.4): each batch uses 128
# with probability 0.5, else 2048, and 2048 alone in the last 10% of steps; tested with 2048.
include("configs/swax/swax_1p4b_base.py")
out_dir = "out/swax_1p4b_stochastic"
window_schedule = "stochastic"
