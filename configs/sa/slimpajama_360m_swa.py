# The 360M recipe of paper 000 (App. B-C) with sliding-window attention, w=256.
#   torchrun --standalone --nproc_per_node=4 train.py configs/sa/slimpajama_360m_swa.py --wandb_log=True
include("configs/sa/slimpajama_360m_full.py")
out_dir = "out/slimpajama_360m_swa"
attn_pattern = "swa"
swa_window = 256
