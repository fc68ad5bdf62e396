# Paper 004 (App. D): GPT-2 small on OpenWebText with se_bridge attention (configs/bridges/owt_124m_local.py).
#   torchrun --standalone --nproc_per_node=8 train.py configs/bridges/owt_124m_se_bridge.py --wandb_log=True
include("configs/bridges/owt_124m_local.py")
out_dir = "out/owt_124m_se_bridge"
attn_pattern = "se_bridge"
