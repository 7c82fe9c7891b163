"""A sleep that a signal handler can cut short.

A signal handler runs on the main thread between two bytecodes, possibly
while that thread holds a lock; calling threading.Event.set() from it can
then deadlock on the Event's own lock. So the daemons' handlers only set a
flag and write one byte to a pipe, which wakes `sleep` (select on the pipe).

A Python-level handler only runs on the main thread, and only once that
thread runs bytecode again. A signal delivered to another thread (any
thread may take a process-directed signal) does not interrupt the main
thread's select, so the handler, and the stop, would wait for the sleep to
end. `wake_on_signals()` makes the C-level handler write to the same pipe
(signal.set_wakeup_fd): select returns at once, the handler runs.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from typing import Optional


class Wakeup:
    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._previous_wakeup_fd: Optional[int] = None

    def wake_on_signals(self) -> None:
        """Any signal with a Python handler wakes sleep() (main thread only)."""
        self._previous_wakeup_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)

    def sleep(self, seconds: float) -> None:
        """Sleep up to seconds; return early after wake()."""
        try:
            ready, _, _ = select.select([self._read], [], [], max(0.0, seconds))
            if ready:
                while os.read(self._read, 512):
                    pass
        except (BlockingIOError, InterruptedError):
            pass
        except (OSError, ValueError):  # closed
            pass

    def wake(self) -> None:
        """Safe in a signal handler and from any thread."""
        try:
            os.write(self._write, b"\0")
        except OSError:  # pipe full (a wake-up is pending anyway) or closed
            pass

    @property
    def write_fd(self) -> int:
        """The pipe's write end, for signal.set_wakeup_fd."""
        return self._write

    def close(self) -> None:
        if self._previous_wakeup_fd is not None:
            try:
                signal.set_wakeup_fd(self._previous_wakeup_fd)
            except ValueError:  # not the main thread
                pass
            self._previous_wakeup_fd = None
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._read = self._write = -1
