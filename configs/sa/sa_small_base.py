# CPU-scale counterpart of paper 000's four models (Full, SWA, SA, SA+SWA), trained for a few minutes on
# associative recall over a distance (data/recall.py): the asked value lies 64-84 positions before the answer,
# beyond the receptive field of 4 sliding-window layers of w=16 (4 x 15 = 60 positions), and training counts
# the answers only (loss_after), so the whole gradient goes to the task.
# Each configs/sa/sa_small_*.py includes this file and sets the attention; compare them with
#   python -m scripts.sweep configs/sa/sa_small_{full,swa,sa,sa_swa}.py --out=out/sweeps/sa_small --eval="--tasks=recall"
out_dir = "out/sa_small"
dataset = "recall_byte"  # generated on first use
loss_after = ">"  # the recall corpus's answer marker
arch = "llama"  # the recipe's Transformer++: RMSNorm, SwiGLU, RoPE, no biases
bias = False
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128  # with w=16 the SA window covers 1/8 of the sequence, as w=256 of n=2048 in the recipe
swa_window = 16
attn_gate = True  # the recipe's single output gate (sa_swa has one per path instead)
attn_pattern = "full"
batch_size = 16
gradient_accumulation_steps = 1
max_iters = 3000
learning_rate = 3e-3
min_lr = 3e-4
warmup_iters = 100
lr_decay_iters = 3000
beta1, beta2 = 0.9, 0.95
weight_decay = 0.1
eval_interval = 500
eval_iters = 20
log_interval = 100
device = "cpu"
