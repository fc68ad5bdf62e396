# Paper-scale base of paper 002's Table 2 / 5 / 6 (App. B.2.1): 12 layers, 8 heads, d = 512, head dim 64,
# AdamW (0.9, 0.98), lr 2e-4 with 1,000 warmup steps and cosine decay, 150,000 steps of 16,384 tokens.
# What differs from the paper, so that these perplexities are NOT comparable with its 29-31 (Table 2):
#   - tokens: GPT-2's BPE here; the paper's Wikitext-103 is word-level (a 267K-word vocabulary, adaptive
#     softmax), so perplexity per BPE token is another quantity;
#   - memory: the paper trains Transformer-XL style (each segment attends to the cached previous segment, with
#     relative positions); here segments are independent and positions are RoPE, so no attention reaches
#     past the segment (mswa_wt103_w256/w512 train at 4,096 to hold their largest windows).
# Compare variants with each other under this recipe, not with the paper's numbers.
# Prepare Wikitext-103 (or another corpus) first, e.g. python -m data.prepare --dataset=path/to/wikitext103 --tokenizer=gpt2
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
# memory (python -m scripts.plan_memory configs/mswa/mswa_wt103_mswa.py --world_size=1): one 80 GB GPU, batch 16 x
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
