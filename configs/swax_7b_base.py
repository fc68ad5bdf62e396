# Paper 003's 7B setting (Sec. 4.1, 4.4): 32 blocks, d=4096, otherwise as configs/swax_1p4b_base.py
# (32 heads of 128 dimensions: the paper does not state the 7B head count); 6.87B parameters.
#   torchrun --nnodes=... --nproc_per_node=8 train.py configs/swax_7b_stochastic.py --wandb_log=True
include("configs/swax_1p4b_base.py")
out_dir = "out/swax_7b"
n_layer = 32
n_head = 32
n_embd = 4096
batch_size = 1
gradient_accumulation_steps = 64  # global: 1 x 64 x 16384 = 1,048,576 tokens per step
# memory (python scripts/plan_memory.py configs/swax_7b_stochastic.py): this recipe does not fit 80 GB GPUs under
# DDP at any micro-batch. DDP keeps the whole model on every GPU: float32 weights, gradients and AdamW's two
# moments alone are 16 B/param x 6.87B = 110 GB (140 GiB per GPU with DDP's gradient buckets and autocast's
# bf16 weight copies). It needs sharded training (FSDP: weights, gradients and optimizer state split across
# the GPUs), which this codebase does not have yet; the batch values above are the paper's.
swax_short_prob = 0.75  # the 7B models need the short window more often (App. B, Table 4)
