# The 360M recipe of paper 000 (App. B-C) with gated SA + SWA (Alg. 2): two sigmoid gates, 385M parameters.
#   torchrun --standalone --nproc_per_node=4 train.py configs/sa/slimpajama_360m_sa_swa.py --wandb_log=True
include("configs/sa/slimpajama_360m_full.py")
out_dir = "out/slimpajama_360m_sa_swa"
attn_pattern = "sa_swa"
swa_window = 256
# memory (python -m scripts.plan_memory configs/sa/slimpajama_360m_sa_swa.py --world_size=4): 4 x 80 GB GPUs, batch 16
# x accumulation 120 as the other 360M recipes; the second path and its gates take this one to 72 GiB per GPU,
# the very edge of 80 GB less 10% headroom, so the loss runs 2048 tokens at a time (the logits of a whole
# micro-batch, 16 x 2048 tokens x 32,000, never exist): about 60 GiB per GPU, the same losses
loss_chunk = 2048
