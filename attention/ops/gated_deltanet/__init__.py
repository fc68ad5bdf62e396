"""Gated DeltaNet (Yang, Kautz, Hatamizadeh 2025; the layer and its gated delta rule: attention/gated_deltanet.py): its
forms, equal to float tolerance (tests/layers/test_gated_deltanet.py), and the short convolution before them:

    naive.py       recurrent_gated_delta_rule, the reference and the generation form: one token at a time,
                   constant memory
    chunk.py       chunked_gated_delta_rule, training, O(n): the WY form, exact within chunks, the state between
    fla_kernel.py  fla's Triton chunk kernel (the same chunked algorithm; CUDA, when installed) and its CPU
                   stand-in with fla's contract (fla_chunk_stand_in), for the CPU standing in for CUDA
    conv.py        causal_conv, the short causal depthwise convolution on q, k and v, continuing from a state

The built-in forms take starts (B, n), the tokens where packed documents restart the state from zero, and
causal_conv takes reach, how far back each token's document goes (tests/layers/test_documents_recurrent.py).
"""
