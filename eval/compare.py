"""Run comparison: training runs (local folders or wandb) as plain records (records.py), each evaluation result's
headline numbers (summaries.py), the table of runs and its seed groups (tables.py), plots (plots.py), paired
statistics on per-example results and the NLL gain by window position (paired.py). scripts/compare.py is its
command line; python -m eval writes the summaries into a run's wandb summary.

A run folder is a train.py out_dir: config.json and metrics.jsonl, plus eval/<task>.json from `python -m
eval`. The table shows the config keys that differ across the runs, parameters, tokens seen (last training
step x batch_size x gradient_accumulation_steps x block_size), best validation loss, final training loss and
one summary column per evaluation result (ppl per length and window, NIAH rank accuracy per length averaged
over depth and kind, other tasks per length or overall). Runs whose configs differ only in `seed` form a
group; a second table gives each group's mean +- sample std over its seeds.

Local folders and wandb runs are both turned into the same plain record (see `load_local_run` and
`wandb_record` in records.py), and everything after that (tables, groups, plots) works on those records only.
This module holds what all of them share: the error that stops a comparison, warnings, and what counts as a
number.
"""

from __future__ import annotations

import math
import sys


class CompareError(Exception):
    """A problem with the inputs: printed as one line, exit status 2."""


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
