"""Paper 004 (boundary repair): the six-family sweep and its tables and figures (sweep) and the boundary-copy
demonstration of Theorem 2 (boundary_copy)."""
