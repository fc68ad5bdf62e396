"""SWAX (paper 003): sliding-window attention and a linear-RNN mixer in alternate layers, as named patterns.

The layers are the registry's own (swa from attention/local.py, mlstm, gated_deltanet); this module only names
their hybrids, so `attn_pattern=swax` builds swa, mlstm, swa, mlstm, ... and the README's variant table lists it.
"""

from attention.registry import register_pattern

register_pattern("swax", "swa,mlstm", paper="003",
                 summary="swa's window in every other layer, xLSTM 7B's mLSTM memory (every j <= i) in the others")
register_pattern("swax_gdn", "swa,gated_deltanet", paper="003",
                 summary="swa's window in every other layer, the gated delta rule's state (every j <= i) in the others")
