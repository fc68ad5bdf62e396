"""Gated DeltaNet (Yang, Kautz, Hatamizadeh 2025; the layer and its gated delta rule: attention/gated_deltanet.py):
the rule itself is the recurrence core's delta rule (attention/ops/recurrence); here what is its own:

    fla_kernel.py  fla's Triton chunk kernel (the same chunked algorithm; CUDA, when installed) and its CPU
                   stand-in with fla's contract (fla_chunk_stand_in), for the CPU standing in for CUDA
    conv.py        causal_conv, the short causal depthwise convolution on q, k and v, continuing from a state;
                   it takes reach, how far back each token's document goes, so no convolution reads an earlier
                   document
"""
