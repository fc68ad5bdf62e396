"""The Hopper compile report's library: scripts/hopper_compile.py is its command line."""
