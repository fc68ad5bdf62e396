# Paper 004 (App. D): GPT-2 small on OpenWebText with swa attention (configs/bridges/owt_124m_local.py).
#   torchrun --standalone --nproc_per_node=8 train.py configs/bridges/owt_124m_swa.py --wandb_log=True
include("configs/bridges/owt_124m_local.py")
out_dir = "out/owt_124m_swa"
attn_pattern = "swa"
