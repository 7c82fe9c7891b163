"""Watch: monitor servers that something else runs (launchd, systemd, ...).

One Monitor per configured instance, each ticking on its own small thread so
that a probe waiting out its timeout on one server never delays the others.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Optional

import psutil

from . import compose, defaults, reports

from .act import (
    ActionResult,
    CommandRestart,
    LaunchdRestart,
    SignalRestart,
    SystemdRestart,
    restart_planned,
)
from .config import InstanceConfig, RestartConfig
from .heartbeat import Heartbeat, read_heartbeat
from .log import LoopFailures
from .metrics import Metrics
from .monitor import Monitor, RestartAction
from .process import CpuSampler, ProcessLocator
from .state import StateStore
from .wakeup import Wakeup


class StacksFirst:
    """Before any restart of a live, wedged server (launchctl kickstart -k,
    systemctl restart, a signal, a command): SIGUSR1 for its stacks, a short
    wait, a `wedged` report; then the real action. The report never blocks
    the restart.

    The heartbeat's pid comes from a file the server's user can write, and
    SIGUSR1 kills a process that has no handler for it: that pid is signalled
    only when it is the server's own (its lineage: the located server or one
    of its descendants; with no locator, a process started to write this very
    heartbeat, by its environment) and started before it wrote the beat.
    """

    def __init__(self, action: RestartAction, instance: InstanceConfig,
                 locator: Optional[ProcessLocator]):
        self.action = action
        self.instance = instance
        self.locator = locator
        self.report_dir = reports.report_dir(instance.report_dir)
        self.last_report: Optional[str] = None
        self.refused: Optional[str] = None  # why the heartbeat's pid was not signalled

    def __str__(self) -> str:
        return str(self.action)

    def _pids(self) -> List[int]:
        root: Optional[int] = None
        if self.locator is not None:
            try:
                root = self.locator.find().pid
            except Exception:  # noqa: BLE001 - no process to ask: no stacks from it
                pass
        pids: List[int] = []
        self.refused = None
        if self.instance.heartbeat_file:
            beat = read_heartbeat(self.instance.heartbeat_file)
            # A heartbeat left by a process that is gone: nobody to ask or to
            # refuse (and no report about a process that is no longer there).
            if beat is not None and beat.pid != root and _running(beat.pid):
                self.refused = not_the_server(beat, root, self.instance.heartbeat_file)
                if self.refused is None:
                    pids.append(beat.pid)
        if root is not None:
            pids.append(root)
        return pids

    def restart_planned(self, reason: str) -> ActionResult:
        """A planned restart: nothing is wrong, so no stacks; the action drains."""
        return restart_planned(self.action, reason)

    def restart(self, reason: str) -> ActionResult:
        try:
            # A pid from a stale heartbeat file, or a process already gone,
            # has no stacks to give: no report about a process that is gone.
            pids = [pid for pid in self._pids() if _running(pid)]
            if pids or self.refused:
                extra = {"instance": reports.instance_field(self.instance.name, self.instance.url)}
                if self.refused:
                    extra["stacks_refused"] = self.refused
                path = reports.capture_stacks(
                    pids, reason=reason, directory=self.report_dir,
                    heartbeat_file=self.instance.heartbeat_file, extra=extra)
                self.last_report = str(path) if path else None
        except Exception:  # noqa: BLE001 - evidence never blocks the restart
            pass
        return self.action.restart(reason)


def not_the_server(beat: Heartbeat, root: Optional[int],
                   heartbeat_file: "str | os.PathLike[str]") -> Optional[str]:
    """Why the heartbeat's writer must not be signalled (None: it is the
    server's). Strict: a process we cannot look at is not signalled."""
    try:
        proc = psutil.Process(beat.pid)
        if proc.create_time() > beat.time + 1.0:
            return f"pid {beat.pid} started after the heartbeat was written (a reused pid)"
        if root is not None:
            if root != beat.pid and root not in {p.pid for p in proc.parents()}:
                return f"pid {beat.pid} is not the server (pid {root}) nor its descendant"
            return None
        written = proc.environ().get(defaults.HEARTBEAT_ENV)
    except psutil.NoSuchProcess:
        return f"pid {beat.pid} is not running"
    except psutil.Error as exc:
        return f"cannot look at pid {beat.pid}: {type(exc).__name__}"
    if written is None or os.path.abspath(written) != os.path.abspath(heartbeat_file):
        return (f"pid {beat.pid} was not started to write {heartbeat_file} "
                f"({defaults.HEARTBEAT_ENV} is not set to it in its environment)")
    return None


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def build_action(spec: RestartConfig) -> Optional[RestartAction]:
    """The restart action a [restart] table describes (None for type "none")."""
    if spec.type == "launchd":
        return LaunchdRestart(spec.label, spec.uid, domain=spec.domain, timeout=spec.timeout)
    if spec.type == "systemd":
        return SystemdRestart(spec.unit, spec.user, timeout=spec.timeout)
    if spec.type == "signal":
        grace = defaults.STOP_GRACE_S if spec.grace is None else spec.grace
        return SignalRestart(spec.pid, spec.pidfile, spec.match, grace)
    if spec.type == "command":
        return CommandRestart(list(spec.argv or ()), timeout=spec.timeout)
    return None


def build_locator(instance: InstanceConfig) -> Optional[ProcessLocator]:
    """How to find the server process for CPU evidence, if we can."""
    if instance.pid or instance.pidfile or instance.process_match:
        return ProcessLocator(instance.pid, instance.pidfile, instance.process_match)
    restart = instance.restart
    if restart.type == "signal":  # the process we would signal is the server
        return ProcessLocator(restart.pid, restart.pidfile, restart.match)
    return None


def build_watched_server_monitor(
    instance: InstanceConfig,
    *,
    metrics: Optional[Metrics] = None,
    state: Optional[StateStore] = None,
) -> Monitor:
    """A monitor of a server something else runs (compose.build_monitor):
    found by pid, pidfile or match, restarted by the [restart] table."""
    locator = build_locator(instance)
    return compose.build_monitor(
        instance,
        action=_with_stacks(instance, locator),
        process=CpuSampler(locator.find_cached) if locator else None,
        owner=(lambda: locator.find_cached().pid) if locator else None,
        metrics=metrics,
        state=state,
    )


def _with_stacks(instance: InstanceConfig, locator: Optional[ProcessLocator]):
    spec = instance.restart
    if spec.type == "signal" and spec.grace is None:
        spec = replace(spec, grace=instance.stop_grace)
    action = build_action(spec)
    return None if action is None else StacksFirst(action, instance, locator)


class Watcher:
    """Runs monitors, each every `interval` seconds, until stopped."""

    def __init__(self, monitors: Dict[str, Monitor], intervals: Dict[str, float],
                 control: Optional[Path] = None):
        self.monitors = monitors
        self.intervals = intervals
        self.control = control  # the folder `mlx-watchdog restart` writes to (control.py)
        self._stop = threading.Event()  # for the monitor threads
        # One per monitor: its sleep ends early (stop, a planned restart).
        self._wakes = {name: threading.Event() for name in monitors}
        for name, monitor in monitors.items():
            monitor.wake = self._wakes[name].set
        self._stopping = False  # set by signal handlers: no locks there (wakeup.py)
        self._wakeup = Wakeup()

    def request_stop(self, *_: object) -> None:
        """Stop watching; safe in a signal handler and from any thread."""
        self._stopping = True
        self._wakeup.wake()

    def run(self) -> int:
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, self.request_stop)
            self._wakeup.wake_on_signals()  # even one taken by a monitor thread
        threads: List[threading.Thread] = []
        poller = None
        try:
            if self.control is not None:
                from .control import ControlPoller

                poller = ControlPoller(self.control, self.monitors)
                poller.start()
            for name, monitor in self.monitors.items():
                thread = threading.Thread(
                    target=self._loop, args=(name, monitor, self.intervals[name]), name=name,
                    daemon=True
                )
                thread.start()
                threads.append(thread)
            while not self._stopping:
                self._wakeup.sleep(3600)
        finally:
            self._stop.set()
            for wake in self._wakes.values():
                wake.set()
            if poller is not None:
                poller.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._wakeup.close()
        for thread in threads:
            thread.join(timeout=1.0)  # a probe in flight is abandoned at exit
        stores = {id(m.state): m.state for m in self.monitors.values() if m.state is not None}
        for store in stores.values():
            store.stopped("the watchdog stopped (the server may still run, unwatched)")
        return 0

    def _loop(self, name: str, monitor: Monitor, interval: float) -> None:
        # Nothing may end this thread but the stop: a monitor whose thread
        # died would leave its server unwatched, without a word.
        wake = self._wakes[name]
        failures = LoopFailures(monitor.events, "error", "tick failed; watching goes on")
        started = False
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                if not started:
                    monitor.started()
                    started = True
                monitor.tick()
                failures.ok()
            except Exception:  # noqa: BLE001 - a bug in one monitor must not silence the others
                failures.failed()
            wake.wait(max(0.0, interval - (time.monotonic() - began)))
            wake.clear()
