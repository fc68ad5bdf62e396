"""Evaluation of trained runs: `python -m eval --out_dir=out/RUN --tasks=ppl,niah` (see eval/__main__.py)."""
