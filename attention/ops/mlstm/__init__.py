"""The mLSTM of xLSTM 7B (Beck et al. 2025; the cell is stated in attention/mlstm.py, the layer): its three forms,
equal to float tolerance (tests/layers/test_mlstm.py, which also compares them with mlstm_kernels' own sequence kernel),
beside mlstm_kernels' Triton kernel (op.py):

    naive.py      quadratic_mlstm, the reference, O(n^2): the whole log-weight matrix at once
    chunkwise.py  chunkwise_mlstm, training, O(n): exact within chunks of mlstm_chunk tokens, the state (C, n, m)
                  between them
    recurrent.py  recurrent_mlstm, generation: one token at a time, constant memory
    op.py         mlstm_kernels' Triton chunkwise kernel as two custom ops with autograd (CUDA, when installed;
                  CPU stand-ins with its output contract while the CPU stands in for CUDA), and mlstm_sequence,
                  which runs a whole sequence through it or chunkwise_mlstm

Each form takes starts (B, n), the tokens where packed documents restart the state from zero (naive.py's
attention/documents.py's document_cumsum: the cumulative gates of each document alone; tests/layers/test_documents_recurrent.py).
"""
