"""SIGTERM and SIGINT as a request to stop at the end of a step, after a checkpoint, rather than mid-write."""

import signal


def catch_stop_signals() -> list:
    """SIGTERM and SIGINT ask the run to stop: their numbers are collected here and acted on once all ranks agree
    (the all-reduce of each step), after a checkpoint. A second signal stops at once."""
    received = []

    def request_stop(signum, frame):
        received.append(signum)
        signal.signal(signum, signal.SIG_DFL)

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    return received
