# CPU-scale counterpart of paper 004's 124M comparison (configs/bridges/owt_124m_*.py): the same GPT-2 block (LayerNorm,
# GELU, learned positions, biases, dropout 0) and the same geometry relative to the context, 8 blocks per
# sequence (b = w = 64 of 512 tokens, as 128 of 1024; se_bridge e = 32, as 64), on the facts corpus
# (data/facts.py: the embedded corpus's text with facts stated and asked back at every distance, so that
# models this small learn to retrieve). Each configs/bridges/bridges_cpu_*.py includes this file and sets the
# attention. The six families, trained and diagnosed, with the Table 3 / 4 / 9 layouts:
#   python -m scripts.bridges.sweep --scale=cpu --seeds=1337
out_dir = "out/bridges_cpu"
dataset = "facts_byte"  # generated on first use

arch = "gpt2"
n_layer = 4
n_head = 4
n_embd = 128
block_size = 512
bias = True
dropout = 0.0
attn_pattern = "full"
block_len = 64
swa_window = 64
bridge_width = 64
bridge_extension = 32
bridge_fusion = "branch"

batch_size = 8
gradient_accumulation_steps = 1
max_iters = 2000
learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 100
lr_decay_iters = 2000
weight_decay = 0.1
grad_clip = 1.0

eval_interval = 500
eval_iters = 20
log_interval = 100
device = "cpu"
seed = 1337
