# Paper-scale base of paper 002's Table 2 / 5 / 6 (App. B.2.1): 12 layers, 8 heads, d = 512, head dim 64,
# AdamW (0.9, 0.98), lr 2e-4 with 1,000 warmup steps and cosine decay, 150,000 steps of 16,384 tokens.
# The paper uses Transformer-XL caching and relative positions; this recipe uses RoPE without the cache.
# Prepare Wikitext-103 (or another corpus) first, e.g. python data/prepare.py --dataset=path/to/wikitext103 --tokenizer=gpt2
out_dir = "out/mswa_wt103"
dataset = "wikitext103_gpt2"
arch = "llama"
bias = False
n_layer = 12
n_head = 8
n_embd = 512
block_size = 1024
swa_window = 128
attn_pattern = "swa"
batch_size = 16
gradient_accumulation_steps = 1  # 16 x 1024 = 16,384 tokens per step
# memory (python scripts/plan_memory.py configs/mswa_wt103_mswa.py --world_size=1): one 80 GB GPU, batch 16 x
# accumulation 1, no activation checkpointing: about 17 GiB. On N GPUs keep the 16 sequences per step with
# --batch_size=16/N --gradient_accumulation_steps=N (the accumulation is global and must divide among them)
max_iters = 150000
learning_rate = 2e-4
min_lr = 2e-5
warmup_iters = 1000
lr_decay_iters = 150000
beta1, beta2 = 0.9, 0.98
eval_interval = 2000
eval_iters = 100
compile = True
