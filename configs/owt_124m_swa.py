# Paper 004 (App. D): GPT-2 small on OpenWebText with swa attention; everything else as configs/owt_124m_full.py.
#   torchrun --standalone --nproc_per_node=8 train.py configs/owt_124m_swa.py --wandb_log=True
#   (seeds 1337, 2025, 3047: python scripts/sweep.py configs/owt_124m_*.py --seeds=1337,2025,3047 --out=out/sweeps/owt_124m)
include("configs/owt_124m_full.py")
out_dir = "out/owt_124m_swa"
attn_pattern = "swa"
block_len = 128
swa_window = 128
bridge_width = 128  # bridge, pbb: w = b
bridge_extension = 64  # se_bridge: e
bridge_fusion = "branch"  # the paper's trained models: block and bridge softmaxes summed
