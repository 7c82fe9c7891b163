"""Keep the Mac awake while its server runs: `caffeinate -i -s -w PID`.

A Mac asleep mid-generation is a hang to every client (omlx #1081).
`install launchd` writes ``caffeinate = true`` into the instance's watch
config unless ``--allow-sleep``; the watchdog (the server's sibling, a job of
its own) then runs ``/usr/bin/caffeinate -i -s -w <server pid>`` for the
current server process, and a new one for each new pid.

Why a sibling, not ``caffeinate -i -s <server command>`` as the server's
program: launchd signals the job's own process (its SIGTERM is the shim's
drain) and hands it its Sockets; a wrapper in between would have to forward
both. ``-w PID`` holds the assertions (-i: no idle sleep; -s: no system
sleep on AC power) exactly as long as that process lives, and caffeinate
ends by itself when it does: nothing to clean up, whoever dies first.
caffeinate(8); Apple's PowerManagement, caffeinate.tproj.

Only on macOS; elsewhere ``KeepAwake`` says once that it has nothing to do.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Callable, List, Optional, Sequence

CAFFEINATE = "/usr/bin/caffeinate"


def command(pid: int) -> List[str]:
    return [CAFFEINATE, "-i", "-s", "-w", str(int(pid))]


def _spawn(argv: Sequence[str]):
    return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


class KeepAwake:
    """Each tick, ``observe(pid)`` with the server's pid (None: unknown)."""

    def __init__(self, events, *, spawn: Callable[[Sequence[str]], object] = _spawn,
                 platform: Optional[str] = None):
        self.events = events
        self._spawn = spawn
        self.enabled = (platform or sys.platform) == "darwin"
        self._pid: Optional[int] = None  # the server pid caffeinate watches
        self._process = None
        self._problem: Optional[str] = None
        if not self.enabled:
            events.info("keep-awake", "caffeinate = true: nothing to do here (macOS only)")

    def observe(self, pid: Optional[int]) -> None:
        if not self.enabled or pid is None:
            return
        if pid == self._pid:
            # One caffeinate per server process: when it ends, so did the server
            # (a heartbeat may name a dead pid for a while; no respawn loop).
            if self._process is not None:
                self._process.poll()  # reap it once it ended
            return
        try:
            self._process = self._spawn(command(pid))
        except OSError as exc:
            problem = f"cannot run {CAFFEINATE}: {exc.strerror or exc}; the Mac may sleep"
            if problem != self._problem:
                self.events.warning("keep-awake", problem)
            self._problem = problem
            return
        self.events.info("keep-awake", f"caffeinate -i -s -w {pid}: no sleep while the "
                                       "server runs")
        self._pid, self._problem = pid, None
