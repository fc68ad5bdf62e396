"""Helpers every layer may use (the bottom layer): atomic writes and tables (outputs.py), the machine and its
thread settings (machine.py), GPUs' peak FLOP/s (flops.py), progress bars (progress.py) and run folders
(run_folder.py)."""
