# CPU-scale counterpart of paper 003's SWAX experiments (configs/swax/swax_1p4b_*.py), trained in minutes on
# needle retrieval over a distance (the recall corpus of data/recall.py): a key-value "needle" #k=V|, 60-80
# digits of counting "haystack", then the question ?k> whose answer is V. Only the answers count in the loss.
# Four layers alternate swa and mlstm. With the long window (128, as long as the training sequence) the swa
# layers can answer alone; with the short one (16: two swa layers reach 30 positions) only the mLSTM can.
# Evaluation asks for values 400-480 positions back, beyond any window, where only the mLSTM can answer:
#   python -m scripts.sweep configs/swax/swax_small_{w16,w128,stochastic}.py --out=out/sweeps/swax_small \
#       --eval="--tasks=recall --recall_filler=60:80,400:480 --recall_lengths=128,512"
out_dir = "out/swax_small"
dataset = "recall_byte"  # generated on first use
loss_after = ">"
arch = "llama"  # gated SiLU MLP, RMSNorm, RoPE (theta 10000) in the swa layers, no biases
bias = False
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
attn_pattern = "swax"  # swa, mlstm, swa, mlstm
mlstm_chunk = 32
mlstm_n_head = 4  # as the models in docs/results.md were trained (before the memory's heads were set apart)
swa_window = 128  # the long window: training (fixed) and test-time window
swax_short_window = 16
swax_short_prob = 0.5
swax_anneal_frac = 0.1
batch_size = 16
gradient_accumulation_steps = 1
max_iters = 4000
learning_rate = 3e-3
min_lr = 3e-5  # paper 003: peak / 100
warmup_iters = 100
lr_decay_iters = 4000
weight_decay = 0.1
eval_interval = 500
eval_iters = 20
log_interval = 100
device = "cpu"
