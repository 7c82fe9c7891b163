"""Act: how to restart a server (when is policy.py's decision).

Every action is `restart(reason) -> ActionResult` and never raises; a failure
(non-zero exit, missing binary, no such process) comes back as ok=False with
a detail a person can act on. Commands are argv lists, never shell strings.
The command runner and the process table are injected so tests use fakes.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import psutil

from . import defaults
from .process import (
    SURVIVED,
    TERMINATED,
    ProcessLocator,
    ProcessNotFound,
    ProcessTable,
    drain_wait_s,
    stop_draining,
    terminate_with_grace,
)
from .redact import printable, scrub


@dataclass(frozen=True)
class ActionResult:
    ok: bool
    detail: str


Runner = Callable[[List[str], float], "subprocess.CompletedProcess[str]"]


def run_command(argv: List[str], timeout: float) -> "subprocess.CompletedProcess[str]":
    """The real runner: subprocess.run, output captured, no shell, no stdin."""
    env = {k: v for k, v in os.environ.items() if k != defaults.API_KEY_ENV}
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=env
    )


def restart_planned(action, reason: str) -> ActionResult:
    """A planned restart through action: its restart_planned(reason) when it
    has one (a drain first, no stacks), else its plain restart. A service
    manager's restart (systemctl restart, launchctl kickstart -k) sends
    SIGTERM and waits its stop timeout (30 s), which covers the drain."""
    planned = getattr(action, "restart_planned", None)
    return planned(reason) if planned is not None else action.restart(reason)


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
        return scrub(shlex.join(self.argv))  # shown in logs and the state file

    def __repr__(self) -> str:
        return scrub(f"{type(self).__name__}({self.argv!r})")

    def restart(self, reason: str) -> ActionResult:
        argv, shown = self.argv, str(self)
        try:
            done = self._runner(argv, self.timeout)
        except FileNotFoundError:
            return ActionResult(False, f"{scrub(argv[0])}: command not found")
        except subprocess.TimeoutExpired:
            return ActionResult(False, f"{shown}: timed out after {self.timeout:g}s")
        except OSError as exc:
            return ActionResult(False, f"{shown}: {exc.strerror or exc}")
        if done.returncode != 0:
            output = (done.stderr or done.stdout or "").strip().splitlines()
            # The command's own words: scrubbed, escape sequences shown.
            tail = f": {printable(scrub(output[-1]))[:200]}" if output else ""
            if any("start-limit" in line or "too often" in line for line in output):
                tail += " (start limit hit: attempted too often)"
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
        self.domain = domain or defaults.LAUNCHD_DOMAIN.format(uid=os.getuid() if uid is None else uid)
        super().__init__(["launchctl", "kickstart", "-k", f"{self.domain}/{label}"], **kwargs)


class SystemdRestart(CommandRestart):
    """`systemctl [--user] reset-failed <unit>`, then `systemctl [--user] --no-block restart <unit>`.

    --no-block: a Type=notify unit's restart job lasts until READY=1, that is
    the whole model load; the watchdog queues the job and watches the boot
    through its own boot grace instead of blocking on systemctl.

    reset-failed first: a unit that hit its start limit (StartLimitBurst, in a
    unit edited by hand) stays failed for good and refuses restarts with
    start-limit-hit; the watchdog's own backoff paces restarts instead. A
    refusal naming the start limit is answered with reset-failed and one retry.
    """

    def __init__(self, unit: str, user: bool = True, **kwargs):
        self.unit, self.user = unit, user
        scope = ["--user"] if user else []
        self._reset_argv = ["systemctl", *scope, "reset-failed", unit]
        super().__init__(["systemctl", *scope, "--no-block", "restart", unit], **kwargs)

    def restart(self, reason: str) -> ActionResult:
        self._reset_failed()  # best effort; the restart says what went wrong
        result = super().restart(reason)
        if not result.ok and _START_LIMIT_HIT in result.detail.lower():
            self._reset_failed()
            retried = super().restart(reason)
            if retried.ok:
                return ActionResult(True, f"{retried.detail} (after reset-failed: start limit hit)")
            return retried
        return result

    def _reset_failed(self) -> None:
        try:
            self._runner(list(self._reset_argv), self.timeout)
        except (OSError, subprocess.SubprocessError):
            pass


_START_LIMIT_HIT = "too often"  # "...the start of the service was attempted too often"


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
        return self._stop(lambda send, gone: terminate_with_grace(
            send, gone, self.grace_s, kill_wait_s=5.0))

    def restart_planned(self, reason: str) -> ActionResult:
        """SIGTERM, up to the shim's drain (defaults.DRAIN_TIMEOUT_S plus a
        margin) for the accepted requests to finish, then the normal stop."""
        drain_s = drain_wait_s({})
        return self._stop(lambda send, gone: stop_draining(send, gone, drain_s, self.grace_s))

    def _stop(self, ladder) -> ActionResult:
        table = self.locator.table
        try:
            proc = self.locator.find()
            pid = proc.pid
            outcome = ladder(lambda sig: _send(proc, sig),
                             lambda timeout: not table.wait_gone([proc], timeout))
            if outcome == TERMINATED:
                return ActionResult(True, f"sent SIGTERM to pid {pid}; it exited")
            if outcome == SURVIVED:
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


def _send(proc, sig: int) -> None:
    """SIGKILL, or SIGTERM then SIGCONT (terminate_with_grace)."""
    if sig == signal.SIGKILL:
        proc.kill()
        return
    proc.terminate()
    try:
        proc.resume()
    except psutil.NoSuchProcess:
        pass  # it is gone already, as wanted

