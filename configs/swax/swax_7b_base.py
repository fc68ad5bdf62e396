# Paper 003's 7B setting (Sec. 4.1, 4.4): 32 blocks, d=4096, otherwise as configs/swax/swax_1p4b_base.py: 16
# attention heads in the swa layers (Sec. 4.1, for both sizes; 256 dimensions each), and the mLSTM with xLSTM 7B's
# 8 heads (mlstm_n_head, q/k 256 and v 512 per head).
#   torchrun --nnodes=... --nproc_per_node=8 train.py configs/swax/swax_7b_stochastic.py --wandb_log=True
include("configs/swax/swax_1p4b_base.py")
out_dir = "out/swax_7b"
n_layer = 32
n_head = 16
n_embd = 4096
batch_size = 2
gradient_accumulation_steps = 32  # global: 4 per GPU on 8 GPUs; 2 x 32 x 16384 = 1,048,576 tokens per step
# memory (python -m scripts.plan_memory configs/swax/swax_7b_stochastic.py --world_size=8): 8 x 80 GB GPUs, sharded
# (parallelism=fsdp, from configs/swax/swax_1p4b_base.py), full activation checkpointing: about 55 GiB per GPU
# (13 GiB of it the sharded weights, gradients and AdamW state). Selective checkpointing does not fit even
# one sequence (79 GiB). Under DDP this recipe cannot train at all: 16 B/param x 6.87B = 110 GB on every GPU.
activation_checkpointing = "full"
swax_short_prob = 0.75  # the 7B models need the short window more often (App. B, Table 4)
