"""Progress bars for long work: tqdm on a terminal, nothing when output goes to a log file or a pipe (where
each refresh would be another line)."""

from tqdm import tqdm


def progress_bar(iterable=None, enabled: bool = True, **kwargs):
    """tqdm(iterable, **kwargs), shown only when enabled and stderr is a terminal (tqdm's disable=None)."""
    return tqdm(iterable, disable=None if enabled else True, **kwargs)
