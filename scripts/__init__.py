"""Command lines over the library. Run each from the repository root as a module: python -m scripts.NAME
(--help lists its options)."""
