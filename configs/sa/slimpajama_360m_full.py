# The 360M Transformer++ of paper 000 (App. B-C) with full causal attention on SlimPajama.
#   python -m data.prepare --dataset=slimpajama --tokenizer=mistralai/Mistral-7B-v0.1 --max_tokens=6000000000
#   torchrun --standalone --nproc_per_node=4 train.py configs/sa/slimpajama_360m_full.py --wandb_log=True
out_dir = "out/slimpajama_360m_full"
dataset = "slimpajama_mistralai_Mistral-7B-v0.1"

arch = "llama"  # RMSNorm, SwiGLU, RoPE, no biases
n_layer = 24
n_head = 16
n_embd = 1024
mlp_hidden = 2734  # floor(2.67 * 1024)
block_size = 2048
bias = False
tie_embeddings = True
vocab_size = 32000
attn_pattern = "full"
attn_gate = True  # the single sigmoid output gate of the recipe: 360M parameters with it

batch_size = 16
gradient_accumulation_steps = 120  # global: 30 per GPU on 4 GPUs; 16 x 120 x 2048 = 3.93M tokens per step
# memory (python -m scripts.plan_memory configs/sa/slimpajama_360m_full.py --world_size=4): 4 x 80 GB GPUs, batch 16
# x accumulation 120, no activation checkpointing: about 61 GiB per GPU for full, swa and sa (sa_swa sets
# loss_chunk); a micro-batch of 24 would need selective checkpointing
max_iters = 3815  # ~15B tokens (2.5 epochs of a 6B-token subset)
learning_rate = 3e-4
min_lr = 3e-5
warmup_iters = 127  # 0.5B tokens
lr_decay_iters = 3815
weight_decay = 0.1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0

eval_interval = 250
eval_iters = 50
log_interval = 1
compile = True
dtype = "bfloat16"
wandb_project = "efficient-attention-slimpajama"
