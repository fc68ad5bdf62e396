# Real text at CPU scale: the papers' language-modelling comparisons on WikiText-2 (byte-level), one config per
# variant, all with the same model size and token budget. Prepare a WikiText copy as a local file, articles as
# documents and about 10% of whole articles held out (a user's clone has no copy: download WikiText-2, or
# python -m data.prepare --dataset=wikitext2 --tokenizer=byte from the hub):
#   python -m data.prepare --dataset='path/to/wikitext-2/*.txt' --split_articles --val_fraction=0.1 \
#       --tokenizer=byte --out_dir=data/wikitext2_byte
# Each configs/wikitext/*.py includes this file and sets the attention; three seeds of one paper's rows:
#   python -m scripts.sweep configs/wikitext/sa_{full,swa,sa,sa_swa}.py --seeds=1337,2025,3047 \
#       --out=out/sweeps/wikitext_sa --eval="--tasks=ppl --ppl_lengths=512,2048 --ppl_stream=True"
out_dir = "out/wikitext"
dataset = "wikitext2_byte"
arch = "llama"  # Transformer++: RMSNorm, SwiGLU, RoPE, no biases
bias = False
n_layer = 4
n_head = 4
n_embd = 128  # 0.8M parameters
block_size = 512  # the training length: 8x the window, so the windowed variants are really windowed
swa_window = 64
block_len = 64
bridge_width = 64
bridge_extension = 32
attn_pattern = "full"
batch_size = 8
gradient_accumulation_steps = 1
max_iters = 600  # 600 x 8 x 512 = 2.46M tokens, about one pass over the held-in articles
learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 60
lr_decay_iters = 600
beta1, beta2 = 0.9, 0.95
weight_decay = 0.1
eval_interval = 150
eval_iters = 20
log_interval = 50
device = "cpu"
