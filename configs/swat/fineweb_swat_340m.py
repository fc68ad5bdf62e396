# SWAT at the 340M Transformer++ setting of paper 001 (Sec. 4.1, Table 1): 24 layers, d=1024, 16 heads,
# sigmoid sliding-window attention with window 256, balanced ALiBi and RoPE (SWAT (-+)), training length 4096,
# 0.5M tokens per step, 15B tokens of FineWeb-Edu, Llama 2's 32000-token vocabulary.
#   python -m data.prepare --dataset=fineweb_edu --tokenizer=meta-llama/Llama-2-7b-hf --max_tokens=16000000000
#   torchrun --standalone --nproc_per_node=8 train.py configs/swat/fineweb_swat_340m.py --wandb_log=True
# SWAT (-): --swat_split=16:0 --swat_slopes=alibi; SWAT (+): --swat_split=0:16 --swat_slopes=alibi ("traditional
# ALiBi slopes", 001 App. C.3). Evaluate at longer lengths with the same window:
#   python -m eval --out_dir=out/fineweb_swat_340m --tasks=ppl --ppl_lengths=4096,16384,65536 --ppl_stream=True
out_dir = "out/fineweb_swat_340m"
dataset = "fineweb_edu_meta-llama_Llama-2-7b-hf"

arch = "llama"
n_layer = 24
n_head = 16
n_embd = 1024
mlp_hidden = 2816  # Transformer++'s SwiGLU: 8/3 d rounded up to a multiple of 256; 340M parameters, tied
block_size = 4096
bias = False
tie_embeddings = True
vocab_size = 32000
attn_pattern = "swat"
swa_window = 256
swat_activation = "sigmoid"
swat_rope = True
swat_slopes = "paper"
swat_split = "8:8"

# the paper gives no optimiser settings: those of the Transformer++ baselines it compares with
batch_size = 8
gradient_accumulation_steps = 16  # global: 2 per GPU on 8 GPUs; 8 x 16 x 4096 = 524,288 tokens per step
# memory (python -m scripts.plan_memory configs/swat/fineweb_swat_340m.py): 8 x 80 GB GPUs, batch 8 x accumulation 16,
# no activation checkpointing: about 62 GiB per GPU (a micro-batch of 16 sequences of 4096 tokens would need about
# 116 GiB without checkpointing)
max_iters = 28610  # 15B tokens
learning_rate = 3e-4
min_lr = 3e-5
warmup_iters = 1024  # ~0.5B tokens
lr_decay_iters = 28610
weight_decay = 0.1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0

eval_interval = 500
eval_iters = 50
log_interval = 10
compile = True
dtype = "bfloat16"
wandb_project = "efficient-attention-swat"
