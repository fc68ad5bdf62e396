"""The GPU check's library: scripts/gpu_check.py is its command line."""
