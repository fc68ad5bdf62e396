# Paper 003 on WikiText-2 (configs/wikitext/wikitext_base.py): SWAX (swa, mlstm alternating), window 64,
# schedule stochastic; evaluated at the training length and 4x-8x it with the long window.
include("configs/wikitext/wikitext_base.py")
out_dir = "out/wikitext_swax_stochastic"
attn_pattern = "swax"
swa_window = 64
mlstm_n_head = 4
mlstm_chunk = 32
window_schedule = "stochastic"
swax_short_window = 16
