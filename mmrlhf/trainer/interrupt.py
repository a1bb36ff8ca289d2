"""Stopping a run cleanly: the first Ctrl-C or SIGTERM (how schedulers preempt a job) asks the loop to stop after the
current step and save; a second one aborts at once. Used by every launch mode's loop."""

from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Iterator

STOP_SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


class StopFlag:
    requested = False


@contextmanager
def stop_on_interrupt() -> Iterator[StopFlag]:
    """The first Ctrl-C or SIGTERM asks the loop to stop after the current step (and save, then exit 0 saying how
    to resume); a second one of either kind aborts at once."""
    flag = StopFlag()
    try:
        previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    except ValueError:  # not the main thread: no handler can be installed
        yield flag
        return

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def handler(signum, frame):  # noqa: ARG001
        if flag.requested:
            restore()
            raise KeyboardInterrupt
        flag.requested = True
        name = STOP_SIGNALS.get(signum, f"signal {signum}")
        print(f"\n{name}: finishing this step, then saving a checkpoint (Ctrl-C again to abort without saving)",
              flush=True)

    try:
        for sig in STOP_SIGNALS:
            signal.signal(sig, handler)
    except ValueError:
        yield flag
        return
    try:
        yield flag
    finally:
        restore()
