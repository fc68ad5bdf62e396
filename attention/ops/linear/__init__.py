"""Linear attention with the 2nd-order Taylor feature map (paper 002, after Based; the layer: attention/linear.py):
three forms, equal to float tolerance (tests/layers/test_linear.py), over one feature map:

    feature_map.py  taylor_features, phi(x) = [1, x / d^(1/4), vec(x x^T) / (sqrt(2) sqrt(d))], and taylor_kernel,
                    phi(q) . phi(k) = 1 + t + t^2 / 2 from q . k directly
    naive.py        quadratic_linear_attention, the reference, O(n^2): the causal kernel matrix, rows normalised
    chunk.py        chunked_linear_attention, training, O(n): exact within chunks, the state (S, z) between them
    recurrent.py    recurrent_linear_attention, generation: one token at a time from the state, constant memory

Each takes starts (B, n), the tokens where packed documents restart the state from zero
(tests/layers/test_documents_recurrent.py).
"""
