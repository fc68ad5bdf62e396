"""Paper 000 (stochastic attention): the graph statistics of App. A (graph_stats) and the training-free window
sweep of a pretrained model (hf_window_sweep)."""
