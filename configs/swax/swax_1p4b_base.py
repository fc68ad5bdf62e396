# Paper 003's 1.4B setting (Sec. 4.1): 24 blocks, d=2048, 16 heads, gated SiLU MLP, RoPE theta 10000 in the
# swa layers, swa and mLSTM alternating 1:1, 16K-token sequences from the start, 1M-token batches, 150B
# tokens, warmup + cosine from 3e-4 to 3e-6. The paper's web + code mix is not public: SlimPajama (web,
# books, GitHub code) with the GPT-2 tokenizer stands in (50,304 padded ids, untied embeddings as in xLSTM
# 7B: 1.42B parameters). Each configs/swax/swax_1p4b_*.py includes this file and sets the window or mixers.
#   python -m data.prepare --dataset=slimpajama --tokenizer=gpt2 --max_tokens=150_000_000_000
#   torchrun --standalone --nproc_per_node=8 train.py configs/swax/swax_1p4b_stochastic.py --wandb_log=True
#   python -m eval --out_dir=out/swax_1p4b_stochastic --tasks=niah --niah_lengths=4096,8192,16384,32768,65536
out_dir = "out/swax_1p4b"
dataset = "slimpajama_gpt2"

arch = "llama"
n_layer = 24
n_head = 16
n_embd = 2048
block_size = 16384
bias = False
tie_embeddings = False
vocab_size = 50304
rope_theta = 10000.0
attn_pattern = "swax"  # swa, mlstm, swa, mlstm, ...
mlstm_n_head = 8  # xLSTM 7B's mLSTM heads (q/k 128, v 256 per head at d=2048), set apart from the 16 attention heads
swa_window = 2048  # the long (and test-time) window
swax_short_window = 128
swax_short_prob = 0.5
swax_anneal_frac = 0.1

batch_size = 1
gradient_accumulation_steps = 64  # global: 8 per GPU on 8 GPUs; 1 x 64 x 16384 = 1,048,576 tokens per step
# sharded (FSDP2): weights, gradients and AdamW state split over the GPUs, bf16 compute through FSDP's
# mixed-precision policy, checkpoints as folders ckpt_last/ and ckpt_best/ (README, "Training at scale")
parallelism = "fsdp"
# memory (python -m scripts.plan_memory configs/swax/swax_1p4b_stochastic.py --world_size=8): 8 x 80 GB GPUs, batch 1 x
# accumulation 64, no activation checkpointing: 52-65 GiB per GPU for configs/swax/swax_1p4b_*.py and
# configs/swax/swax_gdn_1p4b_*.py. Under DDP (--parallelism=ddp: 16 B/param on every GPU) one 16K-token sequence
# would need about 82 GiB without checkpointing: add --activation_checkpointing=selective there (58-61 GiB)
activation_checkpointing = "none"
max_iters = 143_051  # 150B tokens
learning_rate = 3e-4
min_lr = 3e-6
warmup_iters = 2000  # not stated in the paper
lr_decay_iters = 143_051
weight_decay = 0.1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0

eval_interval = 2000
eval_iters = 20
log_interval = 10
compile = True
dtype = "bfloat16"
wandb_project = "efficient-attention-swax"
