# GPT-2 small (124M) with full causal attention on OpenWebText: the setting of paper 004 (App. D).
#   python -m data.prepare --dataset=openwebtext --tokenizer=gpt2 --max_tokens=2550000000 --val_fraction=0.02
#   torchrun --standalone --nproc_per_node=8 train.py configs/bridges/owt_124m_full.py --wandb_log=True
out_dir = "out/owt_124m_full"
dataset = "openwebtext_gpt2"

arch = "gpt2"
n_layer = 12
n_head = 12
n_embd = 768
block_size = 1024
bias = True
dropout = 0.0
vocab_size = 50304  # GPT-2's 50257 padded to a multiple of 64
attn_pattern = "full"

batch_size = 16
gradient_accumulation_steps = 8  # global; 16 x 8 x 1024 = 131,072 tokens per step
# memory (python -m scripts.plan_memory configs/bridges/owt_124m_full.py): 8 x 80 GB GPUs, batch 16 x accumulation 8
# (one micro-batch per GPU per step), no activation checkpointing: about 19 GiB per GPU (20 for the bridge
# variants of configs/bridges/owt_124m_local.py); a micro-batch of 32 would not keep the global batch on 8 GPUs
max_iters = 20001  # through step 20,000: the paper's 20,001 updates (App. D)
learning_rate = 2e-4
min_lr = 6e-5
warmup_iters = 1000
lr_decay_iters = 20000
weight_decay = 0.1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0

eval_interval = 500
eval_iters = 100
log_interval = 10
compile = True
seed = 1337  # the paper trains seeds 1337, 2025 and 3047
wandb_project = "efficient-attention-owt"
