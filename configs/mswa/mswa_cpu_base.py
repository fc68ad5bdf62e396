# CPU-scale base of the MSWA experiments (paper 002, Table 2 layout at a size that trains in minutes on 2 cores):
# a Transformer++ (RoPE, RMSNorm, SwiGLU) on the embedded corpus with base window 32 at context 256.
# Each configs/mswa/mswa_cpu_*.py includes this file and sets the attention.
out_dir = "out/mswa_cpu"
dataset = "embedded_byte"
arch = "llama"
bias = False
n_layer = 4
n_head = 4
n_embd = 128
block_size = 256
swa_window = 32
attn_pattern = "swa"
batch_size = 16
gradient_accumulation_steps = 1
max_iters = 600
learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 60
lr_decay_iters = 600
beta1, beta2 = 0.9, 0.98  # as in the paper's App. B.2.1
eval_interval = 150
eval_iters = 20
log_interval = 50
device = "cpu"
