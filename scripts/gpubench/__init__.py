"""The GPU benchmark's library: scripts/gpu_bench.py is its command line."""
