"""The mLSTM of xLSTM 7B (Beck et al. 2025; the cell is stated in attention/mlstm.py, the layer): its cell on the
recurrence core, beside mlstm_kernels' Triton kernel.

    cell.py  mlstm_cell: the gates and normalised read over the core's stabilised recurrence
             (attention/ops/recurrence), in its chunked, one-step and parallel forms, equal to float tolerance
             (tests/layers/test_mlstm.py, which also compares them with mlstm_kernels' own sequence kernel)
    op.py    mlstm_kernels' Triton chunkwise kernel as two custom ops with autograd (CUDA, when installed; CPU
             stand-ins with its output contract while the CPU stands in for CUDA), and mlstm_sequence, which runs
             a whole sequence through it or the cell's chunked form

Every form takes starts (B, n), the tokens where packed documents restart the state from zero.
"""
