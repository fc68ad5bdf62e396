# Paper 004 (App. D): the local-attention geometry shared by configs/bridges/owt_124m_{block,swa,bridge,pbb,se_bridge}.py,
# on top of the 124M recipe of configs/bridges/owt_124m_full.py. Seeds 1337, 2025, 3047:
#   python -m scripts.bridges.sweep --scale=124m --seeds=1337,2025,3047
include("configs/bridges/owt_124m_full.py")
block_len = 128
swa_window = 128
bridge_width = 128  # bridge, pbb: w = b
bridge_extension = 64  # se_bridge: e
bridge_fusion = "branch"  # the paper's trained models: block and bridge softmaxes summed
