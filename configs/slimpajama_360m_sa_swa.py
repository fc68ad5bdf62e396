# The 360M recipe of paper 000 (App. B-C) with gated SA + SWA (Alg. 2): two sigmoid gates, 385M parameters.
#   torchrun --standalone --nproc_per_node=4 train.py configs/slimpajama_360m_sa_swa.py --wandb_log=True
include("configs/slimpajama_360m_full.py")
out_dir = "out/slimpajama_360m_sa_swa"
attn_pattern = "sa_swa"
swa_window = 256
