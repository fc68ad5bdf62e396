# paper 003 at CPU scale (configs/swax/swax_small_base.py): SWAX trained with a stochastic window, 16 with
# probability 0.5 else 128, and 128 alone in the last 10% of steps; tested with 128.
include("configs/swax/swax_small_base.py")
out_dir = "out/swax_small_stochastic"
window_schedule = "stochastic"
