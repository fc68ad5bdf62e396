"""SIGTERM and SIGINT as a request to stop at the end of a step, after a checkpoint, rather than mid-write: said at
once, even while a long step or evaluation holds the main thread, and a second signal stops at once."""

import os
import signal
import sys
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def catch_stop_signals(announce: bool = True, when=lambda: "the current step") -> list:
    """SIGTERM and SIGINT ask the run to stop: their numbers are collected in the list returned and acted on once
    all ranks agree (the all-reduce of each step), after a checkpoint. A thread woken by the signal itself (Python
    runs handlers only between bytecodes, which a step of minutes may not reach) says so at once where announce
    (rank 0), naming when() the stop comes. A second signal ends the process at once, with status 128 + signal:
    checkpoints are written atomically, so the last complete one is kept."""
    received = []

    def stop_now(signum):
        if announce:
            print(f"{signal.Signals(signum).name} again: stopping now, without a checkpoint of this step; the last "
                  "complete checkpoint is kept", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    def request_stop(signum, frame):
        if received:
            stop_now(signum)
        received.append(signum)

    for signum in STOP_SIGNALS:
        signal.signal(signum, request_stop)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)  # written by the C-level handler, at once

    def watch():
        seen = 0
        while True:
            for signum in os.read(wake_read, 64):
                if signum not in STOP_SIGNALS:
                    continue
                seen += 1
                if seen > 1:
                    stop_now(signum)
                if announce:
                    print(f"{signal.Signals(signum).name}: stopping after {when()}, with a checkpoint; a second "
                          "Ctrl-C stops now", file=sys.stderr, flush=True)

    threading.Thread(target=watch, name="stop-signals", daemon=True).start()
    return received
