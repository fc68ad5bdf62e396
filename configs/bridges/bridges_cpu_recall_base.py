# Paper 004's retrieval findings at CPU scale: the models of configs/bridges/bridges_cpu_base.py (b = w = 64 of 512
# tokens, e = 32) trained on the answers of the recall_near corpus (data/recall.py: "#k=V|", 0-100 counting
# digits, "?k>V"), so that the value lies 5-105 positions before its question and a random share of the
# questions sits in the block after the value's, where fixed blocks cannot answer. Answer-only training
# (loss_after) gives models this small the retrieval that language-model training on the facts corpus does not
# (docs/results.md); the diagnostics then ask their geometry probes in the corpus's format (diag_format=recall).
#   python -m scripts.bridges.sweep --scale=cpu_recall --seeds=1337
include("configs/bridges/bridges_cpu_base.py")
out_dir = "out/bridges_cpu_recall"
dataset = "recall_near_byte"  # generated on first use
loss_after = ">"  # the recall corpus's answer marker
max_iters = 1500
lr_decay_iters = 1500
