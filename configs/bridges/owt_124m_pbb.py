# Paper 004 (App. D): GPT-2 small on OpenWebText with pbb attention (configs/bridges/owt_124m_local.py).
#   torchrun --standalone --nproc_per_node=8 train.py configs/bridges/owt_124m_pbb.py --wandb_log=True
include("configs/bridges/owt_124m_local.py")
out_dir = "out/owt_124m_pbb"
attn_pattern = "pbb"
