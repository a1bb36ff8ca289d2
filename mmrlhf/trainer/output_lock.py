"""One writer per ``trainer.output_dir``: an OS lock held for the life of the process.

A scheduler that re-launches a job (or a ``--resume`` typed while the first run still lives) would otherwise clean
the folder or write a checkpoint under the running process's feet. The lock is ``fcntl.flock`` on
``OUTPUT_DIR/.mmrlhf.lock``: the kernel releases it when the holding process dies, however it dies (SIGKILL,
out-of-memory, a node reboot of a local disk), so a stale lock file never blocks a new run. The file records the
holder's pid and host for the error message. On a network file system without ``flock`` support the lock is as good
as that file system's (documented in docs/training.md).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import IO

LOCK_NAME = ".mmrlhf.lock"
_held: dict[str, IO[str]] = {}  # resolved output_dir -> the open lock file (kept open: closing it releases the lock)


class OutputDirInUseError(FileExistsError):
    """Another live process writes into this output_dir."""


def lock_output_dir(out: str | os.PathLike[str]) -> Path:
    """Take the output folder's lock for this process (idempotent within it); raise :class:`OutputDirInUseError`
    naming the folder and the other process when a live process holds it. Returns the lock file's path."""
    import fcntl

    folder = Path(out).resolve()
    key = str(folder)
    path = folder / LOCK_NAME
    if key in _held:
        return path
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+")
    except PermissionError as exc:  # checked before any model loads: the run could never save
        raise PermissionError(f"trainer.output_dir {folder} is not writable ({exc.strerror}): choose another "
                              "folder or fix its permissions") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "an unknown process"
        handle.close()
        raise OutputDirInUseError(
            f"{folder} is in use by another run ({holder}): wait for it to end or stop it, or choose another "
            "trainer.output_dir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    _held[key] = handle
    return path


def release_output_dir(out: str | os.PathLike[str]) -> None:
    """Give the lock back before the process ends (tests, or a process that trains twice)."""
    handle = _held.pop(str(Path(out).resolve()), None)
    if handle is not None:
        handle.close()
