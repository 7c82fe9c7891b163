"""Supervise: run the server as a child process and keep it serving.

The child runs in its own process group, with the hotfix shim on PYTHONPATH
and MLX_HOTFIX_HEARTBEAT_FILE pointing into a private directory. Its
Monitor is built as `watch` builds one (compose.py), with two adapters:
ChildProcess, the process evidence (the child's CPU, and its exit status
once it exited: the judge then restarts it at once, whatever the code;
SIGCHLD wakes the loop), and ChildRestart, the action (SIGTERM and SIGCONT to
the group, SIGKILL after a grace, a new child). Backoff applies to both
(policy.py); it never stops restarting.
Before a wedged child is stopped, SIGUSR1 asks the shim for every thread's
stack and a `wedged` report keeps them (reports.py). SIGTERM or SIGINT is
passed on to the child, then the supervisor exits 0; SIGHUP (a closed
terminal) and SIGQUIT stop it the same way, with SIGTERM to the child. A tick
that raises is logged with its traceback, once while the same failure lasts,
and the loop goes on.

The child never outlives its supervisor: however the supervisor ends (signal,
exception, crash of the loop) its child goes with it; on Linux it gets SIGTERM
when the supervisor dies, even by SIGKILL (PR_SET_PDEATHSIG); elsewhere the
shim in it watches MLX_HOTFIX_PARENT_PID and exits when the supervisor is
gone. A child that exits takes its process group with it (SIGTERM, then SIGKILL).

The listening socket (held_socket.py): unless --no-socket, the supervisor
binds the server's port itself and every child serves on that socket, so
connections wait in its backlog while a child restarts instead of being
refused. A planned restart (`mlx-watchdog restart NAME`, control.py) stops
the child with a drain: SIGTERM, up to the shim's drain timeout plus a
margin for the accepted requests to finish, then the normal stop.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import psutil

from . import contract, defaults, held_socket, reports
from .act import ActionResult
from .compose import build_monitor
from .config import InstanceConfig
from .group_heartbeats import clear_heartbeats
from .policy import RestartPolicy
from .judge import DOWN, Verdict
from .listener import ListenerCheck
from .log import LoopFailures
from .metrics import Metrics
from .monitor import ProcessEvidence
from .probe import ProbeResult
from .process import (CpuSampler, ProcessNotFound, ProcessSample, drain_wait_s, stop_draining,
                      terminate_with_grace)
from .redact import printable
from .signatures import cause_of_exit, death_record, jetsam_match
from .state import StateStore
from .urls import url_from_command  # noqa: F401 - the CLI's and tests' name for it
from .wakeup import Wakeup


class SupervisorError(Exception):
    """The supervisor cannot start (for instance, the command does not exist)."""


def describe_exit(code: Optional[int], shim: bool = True,
                  death: Optional[Mapping[str, object]] = None) -> str:
    """How a child ended, for people. death: the shim's own record of why
    (the heartbeat's ``death`` field, see last_death), which names the real
    cause of a start-up failure (a bad --model, a taken port)."""
    if code is None:
        return "did not exit"
    if death and isinstance(death.get("summary"), str):
        when = " at start-up" if death.get("during_startup") else ""
        return f"exited with code {code}{when}: {printable(death['summary'])[:300]}"
    if code == defaults.SHIM_EXIT_CODE and shim:
        return f"exited with code {code} (the hotfix shim saw the generation thread die)"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def last_death(heartbeat_file: "Optional[str | os.PathLike[str]]",
               pid: int) -> Optional[Mapping[str, object]]:
    """The shim's death record for process pid (the heartbeat's ``death``
    field, written just before it exits), or None."""
    if heartbeat_file is None:
        return None
    from .heartbeat import read_record

    record = read_record(heartbeat_file)
    if not record or record.get("pid") != pid or not isinstance(record.get("death"), dict):
        return None
    return record["death"]


class Child:
    """A child process that leads its own process group."""

    def __init__(self, popen: "subprocess.Popen[bytes]",
                 relay: Optional[threading.Thread] = None,
                 tail: "Optional[collections.deque[str]]" = None):
        self.popen = popen
        self.pid = popen.pid
        self.relay = relay  # the thread copying its output (spawn)
        self.tail = tail if tail is not None else collections.deque(maxlen=OUTPUT_TAIL_LINES)

    def output_tail(self, wait_s: float = 1.0) -> str:
        """The last lines of its output, once the relay has read them (at most
        wait_s: a grandchild may hold the pipe open)."""
        if self.relay is not None:
            self.relay.join(wait_s)
        return "".join(list(self.tail))

    def poll(self) -> Optional[int]:
        return self.popen.poll()

    def stop(self, grace_s: float, sig: Optional[int] = signal.SIGTERM) -> Optional[int]:
        """Send sig (if any) to the group, SIGKILL after grace_s; the exit code."""
        try:
            terminate_with_grace(self.signal_group, self._exited_within, grace_s, first=sig)
            return self.popen.poll()
        finally:
            self.signal_group(signal.SIGKILL)  # anything left in the group

    def stop_draining(self, drain_s: float, grace_s: float) -> Optional[int]:
        """A planned stop (process.stop_draining): SIGTERM, up to drain_s for
        the shim's drain, then the normal stop; the exit code."""
        try:
            stop_draining(self.signal_group, self._exited_within, drain_s, grace_s)
            return self.popen.poll()
        finally:
            self.signal_group(signal.SIGKILL)

    def end_group(self, grace_s: float) -> None:
        """The leader has exited: end what is left of its group (grandchildren).
        SIGTERM, SIGKILL after grace_s."""
        terminate_with_grace(self.signal_group, self._group_gone_within, grace_s, kill_wait_s=0)

    def _exited_within(self, timeout: float) -> bool:
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _group_gone_within(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._group_exists():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _group_exists(self) -> bool:
        try:
            os.killpg(self.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def signal_group(self, sig: int) -> None:
        """Send sig to the group. A stopped process (SIGSTOP, SIGTSTP) acts on a
        signal only once continued, so SIGCONT follows, as systemd does.
        Safe in a signal handler: two system calls."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)
            if sig not in (signal.SIGKILL, signal.SIGCONT):
                os.killpg(self.pid, signal.SIGCONT)


PARENT_PID_ENV = contract.PARENT_PID_ENV  # the shim exits when this process is gone


SERVER_PREFIX = b"[server] "  # on every line of the child's output, in the watchdog's log
# The child's last lines, kept to classify an exit the shim did not explain
# (a native abort's "libc++abi: terminating ...", a group's "[ring] ...").
OUTPUT_TAIL_LINES = 200


def spawn(argv: List[str], env: Mapping[str, str], pass_fds: Sequence[int] = ()) -> Child:
    """Start argv in a new session (its own process group); OSError if it cannot run.

    Its output (stdout and stderr, in order) goes to the watchdog's stderr,
    each line prefixed SERVER_PREFIX, so that the server's lines and the
    watchdog's can be told apart in one log (a terminal, the journal).
    pass_fds: descriptors the child inherits (the held listening socket)."""
    popen = subprocess.Popen(
        argv,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=parent_death_signal(),
        pass_fds=tuple(pass_fds),
    )
    tail: "collections.deque[str]" = collections.deque(maxlen=OUTPUT_TAIL_LINES)
    relay = threading.Thread(target=relay_output, args=(popen.stdout,), kwargs={"tail": tail},
                             daemon=True, name="mlx-watchdog-server-output")
    relay.start()
    return Child(popen, relay, tail)


def relay_output(pipe, prefix: bytes = SERVER_PREFIX,
                 tail: "Optional[collections.deque[str]]" = None) -> None:
    """Copy pipe to our stderr line by line, prefixed, until EOF (every
    process of the group closed it). Known secrets are scrubbed, as in every
    line the watchdog writes. Never raises."""
    from .redact import scrub

    out = getattr(sys.stderr, "buffer", None)
    try:
        for line in iter(pipe.readline, b""):
            decoded = scrub(line.decode("utf-8", "replace"))
            if tail is not None:
                tail.append(decoded[:2000])
            text = decoded.encode("utf-8")
            try:
                if out is not None:
                    out.write(prefix + text)
                    out.flush()
                else:
                    sys.stderr.write((prefix + text).decode("utf-8", "replace"))
                    sys.stderr.flush()
            except (OSError, ValueError):
                pass  # our stderr is gone: keep draining, so the child never blocks
    except (OSError, ValueError):
        pass
    finally:
        with contextlib.suppress(OSError):
            pipe.close()


def parent_death_signal() -> Optional[Callable[[], None]]:
    """On Linux, a preexec function that has the kernel send the child SIGTERM
    when the supervisor dies, however it dies (SIGKILL, the OOM killer).

    The kernel ties this to the thread that forked, so it is used only from
    the main thread, which lives as long as the supervisor. The function is
    looked up before the fork; the child then makes two system calls, no
    imports and no locks, so it is safe to run between fork and exec.
    """
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
        prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                          ctypes.c_ulong]
        prctl.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    supervisor = os.getpid()
    pr_set_pdeathsig, sigterm = 1, int(signal.SIGTERM)

    def preexec() -> None:
        prctl(pr_set_pdeathsig, sigterm, 0, 0, 0)
        if os.getppid() != supervisor:  # it died before the prctl took hold
            os.kill(os.getpid(), sigterm)

    return preexec


class ChildProcess:
    """Process evidence for whichever child is current: its CPU (a sampler)
    and, once it has exited, how (`exited`), which only its parent can know."""

    def __init__(self, supervisor: "Supervisor", cpu: Optional[ProcessEvidence] = None):
        self._supervisor = supervisor
        self._cpu = cpu if cpu is not None else CpuSampler(self._find)

    def _find(self) -> psutil.Process:
        pid = self._supervisor.child_pid()
        if pid is None:
            raise ProcessNotFound("no child")
        return psutil.Process(pid)

    def exited(self) -> Optional[str]:
        return self._supervisor.reap()

    def death(self) -> Optional[Dict[str, Any]]:
        """The class of the last exit (signatures.death_record), once reaped."""
        return self._supervisor.last_death

    def sample(self, rescan: bool = True) -> ProcessSample:
        return self._cpu.sample(rescan)

    def reset(self) -> None:
        self._cpu.reset()


class ChildRestart:
    """The restart action: the supervisor replaces its child."""

    def __init__(self, supervisor: "Supervisor"):
        self._supervisor = supervisor

    def __str__(self) -> str:
        return "replace the child"

    def restart(self, reason: str) -> ActionResult:
        return self._supervisor.restart(reason)

    def restart_planned(self, reason: str) -> ActionResult:
        return self._supervisor.restart(reason, planned=True)


class Supervisor:
    """Runs command as its child and keeps it serving.

    instance holds the options, read as `watch` reads them (compose.py), and
    the supervisor's own: interval, stop_grace, report_dir. Its [restart]
    table is not used: the supervisor restarts its child itself.
    """

    def __init__(
        self,
        command: Sequence[str],
        instance: InstanceConfig,
        *,
        env: Optional[Mapping[str, str]] = None,
        heartbeat_file: "Optional[str | os.PathLike[str]]" = None,
        shim: bool = True,  # the child runs with the hotfix shim (for messages)
        listener_check: bool = True,  # the child must hold the URL's listening port
        stacks_wait_s: float = defaults.STACKS_WAIT_S,
        listen_socket: Optional[socket.socket] = None,  # held across children (held_socket.py)
        control: "Optional[os.PathLike[str]]" = None,  # the folder `restart NAME` writes to
        spawn: Callable[..., Child] = spawn,
        process: Optional[ProcessEvidence] = None,  # tests: CPU evidence instead of psutil's
        probe: Optional[Callable[[], ProbeResult]] = None,  # tests: instead of probing the URL
        policy: Optional[RestartPolicy] = None,  # tests: instead of the instance's
        metrics: Optional[Metrics] = None,
        state: Optional[StateStore] = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        # A SIGKILL death without a report of its own: macOS's jetsam report
        # of that pid (macos.find_jetsam(pid, since=...)), or None (not macOS).
        jetsam: Optional[Callable[..., object]] = None,
    ):
        if not command:
            raise ValueError("no command to supervise")
        if heartbeat_file is not None:
            instance = replace(instance, heartbeat_file=str(heartbeat_file))
        self.command = list(command)
        self.env = dict(os.environ if env is None else env)
        self.env.pop(defaults.API_KEY_ENV, None)  # the server has no use for the probe's key
        self.heartbeat_file = heartbeat_file
        self.shim = shim
        if heartbeat_file is not None:
            self.env[defaults.HEARTBEAT_ENV] = str(heartbeat_file)
        self.env[PARENT_PID_ENV] = str(os.getpid())
        self.env[defaults.INSTANCE_ENV] = instance.name  # the shim's reports name it
        self.interval_s = instance.interval
        self.stop_grace_s = instance.stop_grace
        self.listen_socket = listen_socket
        self.drain_wait_s = drain_wait_s(self.env)
        self.control = control
        self.report_dir = reports.report_dir(instance.report_dir)
        self.stacks_wait_s = stacks_wait_s
        self.last_report: Optional[str] = None
        if shim:  # the shim and the watchdog must agree on where reports go
            self.env[defaults.REPORT_DIR_ENV] = str(self.report_dir)
        self.child: Optional[Child] = None
        self.last_death: Optional[Dict[str, Any]] = None  # the class of the last exit
        self._child_started: Optional[float] = None  # wall clock, for the jetsam lookup
        if jetsam is None:
            from .macos import find_jetsam, is_macos

            jetsam = find_jetsam if is_macos() else None
        self._jetsam = jetsam
        self._spawn = spawn
        self._wall_clock = wall_clock
        self._clock = clock
        self._exit = "is not running"
        # Stopping is flags and a pipe, never a lock: see wakeup.py.
        self._stopping = False
        self._stop_signal = signal.SIGTERM
        self._wakeup = Wakeup()
        self._signalled: Optional[int] = None  # the pid the stop signal went to
        self.monitor = build_monitor(
            instance,
            action=ChildRestart(self),
            process=ChildProcess(self, process),
            owner=self.child_pid,
            # Evidence must be our child's: is it the one listening on the URL?
            listener=ListenerCheck(instance.url, self.child_pid) if listener_check else None,
            probe=probe,
            policy=policy,
            metrics=metrics,
            state=state,
            clock=clock,
            wall_clock=wall_clock,
            expect_shim=shim and heartbeat_file is not None,
        )
        self.events = self.monitor.events
        self.monitor.wake = self._wakeup.wake  # a planned restart is done at once

    def child_pid(self) -> Optional[int]:
        """The pid of the running child, for evidence that must be its own."""
        child = self.child
        return child.pid if child is not None else None

    # -- one iteration -----------------------------------------------------

    def start(self) -> None:
        """Start the child for the first time; SupervisorError if it cannot run."""
        result = self._spawn_child()
        if not result.ok:
            raise SupervisorError(result.detail)
        self.events.info("spawned", result.detail, pid=self.child.pid)
        self.monitor.started()

    def tick(self) -> Verdict:
        if self._stopping:
            self.reap()
            if self.child is None:
                return Verdict(DOWN, f"server {self._exit}; shutting down")
        return self.monitor.tick()

    def reap(self) -> Optional[str]:
        """How the child ended, once it has (None while it runs); an exit is
        logged once and takes what is left of the child's group with it."""
        if self.child is not None:
            code = self.child.poll()
            if code is None:
                return None
            death = last_death(self.heartbeat_file, self.child.pid) if self.shim else None
            self._exit = describe_exit(code, self.shim, death)
            tail = getattr(self.child, "output_tail", None)
            match = cause_of_exit(code, death, pid=self.child.pid,
                                  output=tail() if tail is not None else None,
                                  hosts=self._group_hosts())
            self.last_death = death_record(match, pid=self.child.pid, exit_code=code,
                                           time=self._wall_clock())
            # Asked to stop, the child's exit is what we wanted: no warning.
            log = self.events.info if self._stopping else self.events.warning
            log("exited", f"server {self._exit}", returncode=code, death_cause=match.cls)
            if match.cls == "killed" and not self._stopping:  # it left no report: one here
                # macOS: jetsam's own file names it (cause jetsam); else what is known.
                jetsam = death is None and self._note_jetsam(self.child.pid)
                if jetsam:
                    self.last_death = death_record(jetsam_match(jetsam), pid=self.child.pid,
                                                   exit_code=code, time=self._wall_clock())
                else:
                    path = reports.write_killed_report(self.last_death,
                                                       directory=self.report_dir,
                                                       extra=self._report_extra())
                    if path is not None:
                        self.last_report = str(path)
                        self.events.info("report", f"wrote {path}", kind="killed")
            self.child.end_group(min(self.stop_grace_s, 2.0))  # no orphaned grandchildren
            self.child = None
        return self._exit

    def _report_extra(self) -> Dict[str, Any]:
        return {"command": reports_argv(self.command),
                "instance": reports.instance_field(self.monitor.name, self.monitor.url,
                                                   self.command)}

    def _group_hosts(self) -> Optional[List[str]]:
        """The hosts of an mlx.launch child, in rank order (None: not a group)."""
        try:
            from .group_launch import parse_launch

            command = parse_launch(self.command)
        except Exception:  # noqa: BLE001 - a hostfile gone since the start: no names
            return None
        return None if command is None else [host.ssh for host in command.hosts]

    def restart(self, reason: str, *, planned: bool = False) -> ActionResult:
        """Stop the child (if any), start a new one (ChildRestart).

        planned: nothing is wrong with the child, so no stacks and no report;
        it drains first (Child.stop_draining) instead of a plain stop."""
        if self._stopping:
            return ActionResult(False, "the supervisor is shutting down")
        stopped = ""
        if self.child is not None:
            pid = self.child.pid
            if planned:
                code = self.child.stop_draining(self.drain_wait_s, self.stop_grace_s)
            else:
                self._capture_stacks(reason)
                code = self.child.stop(self.stop_grace_s)
            self.child = None
            stopped = f"pid {pid} {describe_exit(code, self.shim)}"
            self.events.info("stopped", stopped)
        result = self._spawn_child()
        if result.ok and stopped:
            return ActionResult(True, f"{stopped}; {result.detail}")
        return result

    def _note_jetsam(self, pid: int) -> Optional[Dict[str, Any]]:
        """A child SIGKILLed by no one we know of, with no report of its own:
        on macOS, look for the jetsam report that names it (its pid, the
        largest process, the reason), and write a report with cause jetsam.
        What jetsam said (None: not found, or not macOS). Never raises."""
        if self._jetsam is None:
            return None
        try:
            kill = self._jetsam(pid, since=(self._child_started or 0) - 60)
        except Exception:  # noqa: BLE001 - evidence must never stop the respawn
            return None
        if kill is None:
            return None
        what = kill.describe()
        self.events.warning("jetsam", what, pid=pid)
        self._exit = f"{self._exit}: {what}"
        path = reports.write_report(self.report_dir, {
            "schema": reports.SCHEMA, "kind": "killed", "cause": "jetsam",
            "time": time.time(), "pid": pid, "source": "watchdog",
            "reason": f"macOS {what}", "exit_code": -signal.SIGKILL, "in_flight": None,
            "jetsam": {"pid": kill.pid, "name": kill.name, "reason": kill.reason,
                       "largest_process": kill.largest_process,
                       "resident_bytes": kill.resident_bytes, "timestamp": kill.timestamp,
                       "file": kill.path},
            "instance": reports.instance_field(self.monitor.name, self.monitor.url,
                                               self.command),
        })
        if path is not None:
            self.last_report = str(path)
            self.events.info("report", f"wrote {path}", kind="killed", cause="jetsam")
        return {"pid": kill.pid, "name": kill.name, "reason": kill.reason,
                "largest_process": kill.largest_process}

    def _capture_stacks(self, reason: str) -> None:
        """SIGUSR1 to the child's processes (those with the shim's stacks
        file), a short wait, a `wedged` report. Never raises."""
        if not self.shim or self.child is None:
            return
        pids = [self.child.pid]
        with contextlib.suppress(psutil.Error):
            pids += [p.pid for p in psutil.Process(self.child.pid).children(recursive=True)]
        path = reports.capture_stacks(
            pids,
            reason=reason,
            directory=self.report_dir,
            heartbeat_file=self.heartbeat_file,
            wait_s=self.stacks_wait_s,
            extra=self._report_extra(),
        )
        if path is not None:
            self.last_report = str(path)
            self.events.info("report", f"wrote {path}", kind="wedged")

    def _spawn_child(self) -> ActionResult:
        if self._stopping:
            return ActionResult(False, "the supervisor is shutting down")
        if self.heartbeat_file is not None:
            # A heartbeat left by the previous child (any rank) would look stale.
            clear_heartbeats(self.heartbeat_file)
        try:
            if self.listen_socket is not None:
                fd = self.listen_socket.fileno()
                argv = held_socket.command(self.command, fd, self.env)
                self.child = self._spawn(argv, self.env, pass_fds=(fd,))
            else:
                self.child = self._spawn(self.command, self.env)
            self._child_started = time.time()
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
        self.monitor.stopping = True  # a tick under way restarts nothing
        child = self.child
        if child is not None and self._signalled != child.pid:
            self._signalled = child.pid
            child.signal_group(signum)
        self._wakeup.wake()

    def _on_stop_signal(self, signum: int, _frame: object = None) -> None:
        # A closed terminal (SIGHUP) or SIGQUIT stops us like SIGTERM; the
        # child gets SIGTERM, not a signal that would dump its core.
        self.request_stop(signum if signum in (signal.SIGTERM, signal.SIGINT) else signal.SIGTERM)

    def run(self) -> int:
        """Run until SIGTERM/SIGINT/SIGHUP/SIGQUIT (or request_stop); returns 0."""
        handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
        previous = {}
        previous_wakeup_fd = None
        if threading.current_thread() is threading.main_thread():
            for sig in handled:
                previous[sig] = signal.signal(sig, self._on_stop_signal)
            # The C-level handler writes to the pipe at once, so the loop's
            # select wakes even before the Python handler gets to run.
            previous_wakeup_fd = signal.set_wakeup_fd(
                self._wakeup.write_fd, warn_on_full_buffer=False
            )
            # A child that exits (or stops) wakes the loop at once: it is
            # respawned now, not at the next probe, up to an interval later.
            previous[signal.SIGCHLD] = signal.signal(
                signal.SIGCHLD, lambda signum, _: self._wakeup.wake()
            )
        atexit.register(self._kill_child)  # even if the loop itself breaks
        failures = LoopFailures(self.events, "tick-error", "a tick failed; supervising goes on")
        poller = None
        if self.control is not None:
            from .control import ControlPoller

            poller = ControlPoller(Path(self.control), {self.monitor.name: self.monitor},
                                   self.events)
            poller.start()
        try:
            self.start()
            while not self._stopping:
                began = self._clock()
                try:
                    self.tick()
                    failures.ok()
                except Exception:  # noqa: BLE001 - a bug in one tick must not end supervision
                    failures.failed()
                # While waiting to respawn, look again soon: the backoff may be short.
                interval = self.interval_s if self.child is not None else min(self.interval_s, 1.0)
                if not self._stopping:
                    self._wakeup.sleep(interval - (self._clock() - began))
        finally:
            if poller is not None:
                poller.stop()
            try:
                self.shutdown()
            finally:
                self._kill_child()
                atexit.unregister(self._kill_child)
                if previous_wakeup_fd is not None:
                    signal.set_wakeup_fd(previous_wakeup_fd)
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
                self._wakeup.close()
        return 0

    def _kill_child(self) -> None:
        """The last resort: SIGKILL whatever is left of the child's group."""
        child = self.child
        if child is not None and child.poll() is None:
            child.signal_group(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(timeout=10)
        if child is not None:
            child.signal_group(signal.SIGKILL)  # stragglers in its group

    def shutdown(self) -> None:
        state = self.monitor.state
        if state is not None:
            state.flush()
        name = signal.Signals(self._stop_signal).name
        if self.child is not None:
            pid = self.child.pid
            self.events.info("stopping",
                             f"{name} to pid {pid}, SIGKILL after {self.stop_grace_s:g}s")
            already = self._signalled == pid
            code = self.child.stop(self.stop_grace_s, None if already else self._stop_signal)
            self.child = None
            self.events.info("stopped", f"pid {pid} {describe_exit(code, self.shim)}")
        if state is not None:
            state.stopped(f"the supervisor stopped ({name}), and its server with it")


def reports_argv(command: Sequence[str]) -> List[str]:
    """The command for a report, with secret-looking flag values hidden."""
    from .redact import redact_argv

    return redact_argv(list(command))
