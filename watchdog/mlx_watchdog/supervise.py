"""Supervise: run the server as a child process and keep it serving.

The child runs in its own process group, with the hotfix shim on PYTHONPATH
and MLX_HOTFIX_HEARTBEAT_FILE pointing into a private directory. Each tick
the supervisor restarts the child if it exited (whatever the exit code;
SIGCHLD wakes the loop at once) and otherwise lets its Monitor probe, judge
and, when wedged, restart it (SIGTERM and SIGCONT to the group, SIGKILL after
a grace). Backoff and crash-loop limits apply to both. SIGTERM or SIGINT is
passed on to the child, then the supervisor exits 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Callable, List, Mapping, Optional, Sequence

import psutil

from . import defaults
from .act import ActionResult, RestartPolicy
from .heartbeat import HeartbeatTracker
from .throughput import ReportWatcher, ThroughputTracker, report_dir
from .judge import DOWN, EXITED, Judge, JudgeConfig, Verdict
from .log import Events
from .metrics import Metrics
from .monitor import Monitor, ProcessEvidence
from .probe import ProbeResult
from .process import CpuSampler, ProcessNotFound, ProcessSample
from .state import StateStore
from .wakeup import Wakeup


class SupervisorError(Exception):
    """The supervisor cannot start (for instance, the command does not exist)."""


def url_from_command(command: Sequence[str]) -> str:
    """The URL an mlx_lm.server command will listen on (--host, --port)."""
    values = {"--host": defaults.HOST, "--port": str(defaults.PORT)}
    args = list(command)
    for i, arg in enumerate(args):
        for flag in values:
            if arg == flag and i + 1 < len(args):
                values[flag] = args[i + 1]
            elif arg.startswith(flag + "="):
                values[flag] = arg.split("=", 1)[1]
    host, port = values["--host"], values["--port"]
    if not port.isdigit():
        raise ValueError(f"cannot read a port number from --port {port!r}")
    # A wildcard bind is reached through loopback.
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{int(port)}"


def describe_exit(code: Optional[int], shim: bool = True) -> str:
    if code is None:
        return "did not exit"
    if code == defaults.SHIM_EXIT_CODE and shim:
        return f"exited with code {code} (the hotfix shim saw the generation thread die)"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Child:
    """A child process that leads its own process group."""

    def __init__(self, popen: "subprocess.Popen[bytes]"):
        self.popen = popen
        self.pid = popen.pid

    def poll(self) -> Optional[int]:
        return self.popen.poll()

    def stop(self, grace_s: float, sig: Optional[int] = signal.SIGTERM) -> Optional[int]:
        """Send sig (if any) to the group, SIGKILL after grace_s; the exit code."""
        if sig is not None:
            self.signal_group(sig)
        try:
            return self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.signal_group(signal.SIGKILL)
            try:
                return self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                return None
        finally:
            self.signal_group(signal.SIGKILL)  # anything left in the group

    def signal_group(self, sig: int) -> None:
        """Send sig to the group. A stopped process (SIGSTOP, SIGTSTP) acts on a
        signal only once continued, so SIGCONT follows, as systemd does.
        Safe in a signal handler: two system calls."""
        try:
            os.killpg(self.pid, sig)
            if sig not in (signal.SIGKILL, signal.SIGCONT):
                os.killpg(self.pid, signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            pass


def spawn(argv: List[str], env: Mapping[str, str]) -> Child:
    """Start argv in a new session (its own process group); OSError if it cannot run."""
    return Child(
        subprocess.Popen(argv, env=dict(env), stdin=subprocess.DEVNULL, start_new_session=True)
    )


class _ChildCpu:
    """CPU evidence for whichever child is current."""

    def __init__(self, supervisor: "Supervisor"):
        self._supervisor = supervisor
        self._sampler = CpuSampler(self._find)

    def _find(self) -> psutil.Process:
        child = self._supervisor.child
        if child is None:
            raise ProcessNotFound("no child")
        return psutil.Process(child.pid)

    def sample(self, rescan: bool = True) -> ProcessSample:
        return self._sampler.sample(rescan)

    def reset(self) -> None:
        self._sampler.reset()


class Supervisor:
    def __init__(
        self,
        command: Sequence[str],
        *,
        probe: Callable[[], ProbeResult],
        name: str,
        url: str = "",
        env: Optional[Mapping[str, str]] = None,
        heartbeat_file: "Optional[str | os.PathLike[str]]" = None,
        shim: bool = True,  # the child runs with the hotfix shim (for messages)
        judge_config: JudgeConfig = JudgeConfig(),
        policy: Optional[RestartPolicy] = None,
        interval_s: float = defaults.PROBE_INTERVAL_S,
        stop_grace_s: float = defaults.STOP_GRACE_S,
        spawn: Callable[[List[str], Mapping[str, str]], Child] = spawn,
        process: Optional[ProcessEvidence] = None,
        metrics: Optional[Metrics] = None,
        state: Optional[StateStore] = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ):
        if not command:
            raise ValueError("no command to supervise")
        self.command = list(command)
        self.env = dict(os.environ if env is None else env)
        self.heartbeat_file = heartbeat_file
        self.shim = shim
        if heartbeat_file is not None:
            self.env[defaults.HEARTBEAT_ENV] = str(heartbeat_file)
        self.interval_s = interval_s
        self.stop_grace_s = stop_grace_s
        self.child: Optional[Child] = None
        self._spawn = spawn
        self._clock = clock
        self._exit = "is not running"
        # Stopping is flags and a pipe, never a lock: see wakeup.py.
        self._stopping = False
        self._stop_signal = signal.SIGTERM
        self._wakeup = Wakeup()
        self._signalled: Optional[int] = None  # the pid the stop signal went to
        self.monitor = Monitor(
            name,
            probe,
            judge=Judge(judge_config),
            policy=policy or RestartPolicy(),
            action=self,
            url=url,
            heartbeat=HeartbeatTracker(heartbeat_file) if heartbeat_file is not None else None,
            process=process if process is not None else _ChildCpu(self),
            events=Events(name),
            metrics=metrics,
            state=state,
            throughput=ThroughputTracker(heartbeat_file) if heartbeat_file is not None else None,
            reports=ReportWatcher(report_dir(self.env)),
            clock=clock,
            wall_clock=wall_clock,
        )
        self.events = self.monitor.events

    # -- one iteration -----------------------------------------------------

    def start(self) -> None:
        """Start the child for the first time; SupervisorError if it cannot run."""
        result = self._spawn_child()
        if not result.ok:
            raise SupervisorError(result.detail)
        self.events.info("spawned", result.detail, pid=self.child.pid)
        self.monitor.started()

    def tick(self) -> Verdict:
        if self.child is not None:
            code = self.child.poll()
            if code is not None:
                self._exit = describe_exit(code, self.shim)
                self.events.warning("exited", f"server {self._exit}", returncode=code)
                self.child = None
        if self.child is None:
            if self._stopping:
                return Verdict(DOWN, f"server {self._exit}; shutting down")
            verdict = self.monitor.restart(Verdict(DOWN, f"server {self._exit}", True, EXITED))
            self.monitor.report(verdict)
            return verdict
        return self.monitor.tick()

    def restart(self, reason: str) -> ActionResult:
        """The monitor's restart action: stop the child (if any), start a new one."""
        if self._stopping:
            return ActionResult(False, "the supervisor is shutting down")
        if self.child is not None:
            pid, code = self.child.pid, self.child.stop(self.stop_grace_s)
            self.child = None
            self.events.info("stopped", f"pid {pid} {describe_exit(code, self.shim)}")
        return self._spawn_child()

    def _spawn_child(self) -> ActionResult:
        if self._stopping:
            return ActionResult(False, "the supervisor is shutting down")
        if self.heartbeat_file is not None:
            try:  # a heartbeat left by the previous child would look stale
                os.unlink(self.heartbeat_file)
            except OSError:
                pass
        try:
            self.child = self._spawn(self.command, self.env)
        except OSError as exc:
            return ActionResult(False, f"cannot run {self.command[0]!r}: {exc.strerror or exc}")
        return ActionResult(True, f"started pid {self.child.pid}")

    # -- the loop ------------------------------------------------------------

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """Stop the loop and pass signum on to the child right away.

        Right away, not after the current tick: a service manager that gives
        up waiting would kill us and orphan the child in its own group.
        Safe in a signal handler: no locks, no logging.
        """
        self._stop_signal = signum
        self._stopping = True
        child = self.child
        if child is not None and self._signalled != child.pid:
            self._signalled = child.pid
            child.signal_group(signum)
        self._wakeup.wake()

    def run(self) -> int:
        """Run until SIGTERM/SIGINT (or request_stop); returns the exit status, 0."""
        handled = (signal.SIGTERM, signal.SIGINT)
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in handled:
                previous[sig] = signal.signal(sig, lambda signum, _: self.request_stop(signum))
            # A child that exits (or stops) wakes the loop at once: it is
            # respawned now, not at the next probe, up to an interval later.
            previous[signal.SIGCHLD] = signal.signal(
                signal.SIGCHLD, lambda signum, _: self._wakeup.wake()
            )
        try:
            self.start()
            while not self._stopping:
                began = self._clock()
                self.tick()
                # While waiting to respawn, look again soon: the backoff may be short.
                interval = self.interval_s if self.child is not None else min(self.interval_s, 1.0)
                if not self._stopping:
                    self._wakeup.sleep(interval - (self._clock() - began))
        finally:
            self.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._wakeup.close()
        return 0

    def shutdown(self) -> None:
        if self.monitor.state is not None:
            self.monitor.state.flush()
        if self.child is None:
            return
        pid, name = self.child.pid, signal.Signals(self._stop_signal).name
        self.events.info("stopping", f"{name} to pid {pid}, SIGKILL after {self.stop_grace_s:g}s")
        already = self._signalled == pid
        code = self.child.stop(self.stop_grace_s, None if already else self._stop_signal)
        self.child = None
        self.events.info("stopped", f"pid {pid} {describe_exit(code, self.shim)}")
