# A small GPT on the embedded corpus (data/embedded.py): no download, trains on 2 CPU cores in a few minutes.
#   python train.py configs/quickstart.py
out_dir = "out/quickstart"
dataset = "embedded_byte"  # prepared automatically on first use

arch = "gpt2"
n_layer = 4
n_head = 4
n_embd = 128
block_size = 256
dropout = 0.0
attn_pattern = "full"

batch_size = 16
gradient_accumulation_steps = 1
max_iters = 800
learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 100  # then cosine decay to min_lr at max_iters (lr_decay_iters = 0 follows max_iters)
weight_decay = 0.1

eval_interval = 200
eval_iters = 20
log_interval = 50
device = "cpu"
seed = 1337
