"""Act: how to restart a server, and when not to.

Every action is `restart(reason) -> ActionResult` and never raises; a failure
(non-zero exit, missing binary, no such process) comes back as ok=False with
a detail a person can act on. Commands are argv lists, never shell strings.
The command runner and the process table are injected so tests use fakes.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, List, Optional, Sequence

import psutil

from . import defaults
from .process import ProcessLocator, ProcessNotFound, ProcessTable


@dataclass(frozen=True)
class ActionResult:
    ok: bool
    detail: str


Runner = Callable[[List[str], float], "subprocess.CompletedProcess[str]"]


def run_command(argv: List[str], timeout: float) -> "subprocess.CompletedProcess[str]":
    """The real runner: subprocess.run, output captured, no shell, no stdin."""
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


class CommandRestart:
    """Run a command (an argv list) that restarts the server."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        runner: Runner = run_command,
        timeout: float = defaults.ACTION_TIMEOUT_S,
    ):
        if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError("argv must be a non-empty list of strings")
        self._argv = list(argv)
        self._runner = runner
        self.timeout = timeout

    @property
    def argv(self) -> List[str]:
        return list(self._argv)

    def __str__(self) -> str:
        return shlex.join(self.argv)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.argv!r})"

    def restart(self, reason: str) -> ActionResult:
        argv, shown = self.argv, str(self)
        try:
            done = self._runner(argv, self.timeout)
        except FileNotFoundError:
            return ActionResult(False, f"{argv[0]}: command not found")
        except subprocess.TimeoutExpired:
            return ActionResult(False, f"{shown}: timed out after {self.timeout:g}s")
        except OSError as exc:
            return ActionResult(False, f"{shown}: {exc.strerror or exc}")
        if done.returncode != 0:
            output = (done.stderr or done.stdout or "").strip().splitlines()
            tail = f": {output[-1][:200]}" if output else ""
            return ActionResult(False, f"{shown} exited with status {done.returncode}{tail}")
        return ActionResult(True, f"ran {shown}")


class LaunchdRestart(CommandRestart):
    """`launchctl kickstart -k <domain>/<label>`: launchd kills and restarts the job.

    The domain defaults to gui/<uid> (a LaunchAgent); use domain="system" for
    a LaunchDaemon.
    """

    def __init__(
        self, label: str, uid: Optional[int] = None, *, domain: Optional[str] = None, **kwargs
    ):
        self.label = label
        self.domain = domain or f"gui/{os.getuid() if uid is None else uid}"
        super().__init__(["launchctl", "kickstart", "-k", f"{self.domain}/{label}"], **kwargs)


class SystemdRestart(CommandRestart):
    """`systemctl [--user] --no-block restart <unit>`.

    --no-block: a Type=notify unit's restart job lasts until READY=1, that is
    the whole model load; the watchdog queues the job and watches the boot
    through its own boot grace instead of blocking on systemctl.
    """

    def __init__(self, unit: str, user: bool = True, **kwargs):
        self.unit, self.user = unit, user
        scope = ["--user"] if user else []
        super().__init__(["systemctl", *scope, "--no-block", "restart", unit], **kwargs)


class SignalRestart:
    """SIGTERM the server, SIGKILL it after a grace period.

    Something else must start it again: launchd KeepAlive, systemd
    Restart=always, a container runtime, a shell loop.
    """

    def __init__(
        self,
        pid: Optional[int] = None,
        pidfile: Optional[str] = None,
        match: Optional[str] = None,
        grace_s: float = defaults.STOP_GRACE_S,
        *,
        table: Optional[ProcessTable] = None,
    ):
        self.locator = ProcessLocator(pid, pidfile, match, table=table)
        self.grace_s = grace_s

    def __str__(self) -> str:
        return f"SIGTERM {self.locator} (SIGKILL after {self.grace_s:g}s)"

    def __repr__(self) -> str:
        return f"SignalRestart({self.locator}, grace_s={self.grace_s:g})"

    def restart(self, reason: str) -> ActionResult:
        table = self.locator.table
        try:
            proc = self.locator.find()
            pid = proc.pid
            proc.terminate()
            _continue(proc)
            if not table.wait_gone([proc], self.grace_s):
                return ActionResult(True, f"sent SIGTERM to pid {pid}; it exited")
            proc.kill()
            if table.wait_gone([proc], 5.0):
                return ActionResult(False, f"pid {pid} survived SIGKILL")
            return ActionResult(True, f"pid {pid} ignored SIGTERM for {self.grace_s:g}s; SIGKILLed")
        except ProcessNotFound as exc:
            return ActionResult(False, str(exc))
        except psutil.NoSuchProcess:
            return ActionResult(True, "the process exited before it could be signalled")
        except psutil.AccessDenied:
            return ActionResult(False, f"not allowed to signal {self.locator}")
        except (psutil.Error, OSError) as exc:
            return ActionResult(False, f"cannot signal {self.locator}: {exc}")


def _continue(proc) -> None:
    """SIGCONT: a stopped process acts on SIGTERM only once continued."""
    try:
        proc.resume()
    except psutil.NoSuchProcess:
        pass  # it is gone already, as wanted


@dataclass(frozen=True)
class RestartDecision:
    allowed: bool
    crash_looping: bool = False
    wait_s: float = 0.0
    reason: str = ""


class RestartPolicy:
    """Boot grace, exponential backoff, and a cap on restarts per window.

    - After each start, failures do not count for `boot_grace_s` (or until the
      first successful probe, or the heartbeat says serving, whichever comes
      first).
    - After n restarts with no healthy probe since, the next one waits
      `backoff_initial_s * 2**(n-1)` after the previous one, at most
      `backoff_max_s` (the first restart does not wait).
    - More than `max_restarts` restarts within `window_s` is a crash loop:
      restarts pause until the oldest falls out of the window.
    Pure: every method takes `now` (monotonic seconds).
    """

    def __init__(
        self,
        *,
        boot_grace_s: float = defaults.BOOT_GRACE_S,
        backoff_initial_s: float = defaults.BACKOFF_INITIAL_S,
        backoff_max_s: float = defaults.BACKOFF_MAX_S,
        max_restarts: int = defaults.MAX_RESTARTS,
        window_s: float = defaults.RESTART_WINDOW_S,
    ):
        self.boot_grace_s = boot_grace_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._grace_until: Optional[float] = None
        self._restarts: Deque[float] = deque()
        self._in_a_row = 0  # restarts since the last healthy probe

    def started(self, now: float) -> None:
        """A server process (re)started now: its boot grace begins."""
        self._grace_until = now + self.boot_grace_s

    def in_grace(self, now: float) -> bool:
        return self._grace_until is not None and now < self._grace_until

    def end_grace(self, now: float) -> None:
        """The new server is loaded and serving: failures count from now on."""
        self._grace_until = None

    def healthy(self, now: float) -> None:
        """A probe succeeded: the boot is over and the backoff starts again."""
        self._grace_until = None
        self._in_a_row = 0

    def backoff_s(self) -> float:
        """The wait before the next restart, counted from the previous one."""
        if self._in_a_row == 0:
            return 0.0
        return min(self.backoff_initial_s * 2 ** (self._in_a_row - 1), self.backoff_max_s)

    def check(self, now: float) -> RestartDecision:
        """May we restart now?"""
        while self._restarts and self._restarts[0] <= now - self.window_s:
            self._restarts.popleft()
        if len(self._restarts) >= self.max_restarts:
            wait = self._restarts[0] + self.window_s - now
            return RestartDecision(
                False,
                crash_looping=True,
                wait_s=wait,
                reason=(
                    f"crash loop: {len(self._restarts)} restarts in {self.window_s:g}s, "
                    f"restarts paused for {wait:.0f}s"
                ),
            )
        if self._restarts:
            wait = self._restarts[-1] + self.backoff_s() - now
            if wait > 0:
                reason = f"restart in {wait:.0f}s (backoff)"
                return RestartDecision(False, wait_s=wait, reason=reason)
        return RestartDecision(True)

    def record_restart(self, now: float) -> None:
        """A restart was attempted now (successful or not: both count)."""
        self._restarts.append(now)
        self._in_a_row += 1
        self.started(now)
