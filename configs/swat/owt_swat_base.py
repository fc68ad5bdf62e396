# Paper 001's Table 3 ablation grid at CPU scale: every window and length of the paper divided by 8 (window
# 128 -> 16, training length 1024 -> 128, evaluation length 16384 -> 2048), 12 heads as in the paper's labels
# (ALiBi-12:0, 8:4, 6:6). Each configs/swat/owt_swat_NN_*.py includes this file and sets one row; the whole grid,
# evaluated at 8x the training length with the trained window (as in the table):
#   python -m scripts.sweep configs/swat/owt_swat_[01]*.py --out=out/sweeps/owt_swat \
#       --eval="--tasks=ppl --ppl_lengths=2048 --ppl_stream=True"
# The paper trains on OpenWebText (python -m data.prepare --dataset=openwebtext --tokenizer=byte); without
# network add --extra="--dataset=embedded_byte".
dataset = "openwebtext_byte"
arch = "llama"  # Transformer++: RMSNorm, SwiGLU, no biases (RoPE only where swat_rope says so)
bias = False
n_layer = 4
n_head = 12
n_embd = 192
attn_pattern = "swat"
swat_slopes = "paper"  # Eq. 4: magnitudes 2^-k per direction
swa_window = 16
block_size = 128
batch_size = 32  # each row keeps batch_size * block_size = 4096 tokens per step
gradient_accumulation_steps = 1
max_iters = 400
learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 40
lr_decay_iters = 400
beta1, beta2 = 0.9, 0.95
weight_decay = 0.1
eval_interval = 200
eval_iters = 20
log_interval = 50
