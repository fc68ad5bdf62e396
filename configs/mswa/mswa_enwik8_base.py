# Paper 002's enwik8 setting (Table 2's bpc column, App. B.2.1): the Wikitext-103 base (12 layers, 8 heads,
# d = 512, AdamW (0.9, 0.98), lr 2e-4, 1,000 warmup steps, cosine decay, 150,000 steps) at the paper's 49,152
# tokens per step, on bytes. bits per character = validation loss (nats per byte) / ln 2.
#   python -m data.prepare --dataset=enwik8 --tokenizer=byte       # 90M / 5M bytes; --enwik8_val=test for test
# Differences from the paper, as for Wikitext-103: no Transformer-XL memory (segments of 1,024 bytes attend
# within themselves; the paper's cached segment lets attention reach further), RoPE instead of XL's relative
# positions. Table 3's linear hybrids take this data with --dataset=enwik8_byte on configs/mswa/mswa_linear_*.py.
include("configs/mswa/mswa_wt103_base.py")
out_dir = "out/mswa_enwik8"
dataset = "enwik8_byte"
vocab_size = 320  # the byte tokenizer's 257 ids, padded to a multiple of 64 (what vocab_size=0 resolves to)
batch_size = 48  # 48 x 1024 = 49,152 bytes per step
# memory (python -m scripts.plan_memory configs/mswa/mswa_enwik8_mswa.py --world_size=1): one 80 GB GPU, batch 48 x
# accumulation 1, no activation checkpointing: about 16 GiB
