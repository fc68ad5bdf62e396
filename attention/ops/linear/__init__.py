"""Linear attention with the 2nd-order Taylor feature map (paper 002, after Based; the layer: attention/linear.py):
the recurrence core (attention/ops/recurrence) with this feature map and no gates.

    feature_map.py  taylor_features, phi(x) = [1, x / d^(1/4), vec(x x^T) / (sqrt(2) sqrt(d))], taylor_kernel,
                    phi(q) . phi(k) = 1 + t + t^2 / 2 from q . k directly, and TAYLOR, the two as the core's
                    FeatureMap
"""
