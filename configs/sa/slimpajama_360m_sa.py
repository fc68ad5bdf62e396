# The 360M recipe of paper 000 (App. B-C) with stochastic attention, w=256 (a fresh permutation per layer and step).
#   torchrun --standalone --nproc_per_node=4 train.py configs/sa/slimpajama_360m_sa.py --wandb_log=True
include("configs/sa/slimpajama_360m_full.py")
out_dir = "out/slimpajama_360m_sa"
attn_pattern = "sa"
swa_window = 256
