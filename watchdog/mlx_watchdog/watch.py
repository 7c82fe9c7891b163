"""Watch: monitor servers that something else runs (launchd, systemd, ...).

One Monitor per configured instance, each ticking on its own small thread so
that a probe waiting out its timeout on one server never delays the others.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Optional

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
from .heartbeat import read_heartbeat
from .metrics import Metrics
from .monitor import Monitor, RestartAction
from .process import CpuSampler, ProcessLocator
from .state import StateStore
from .wakeup import Wakeup


class StacksFirst:
    """Before any restart of a live, wedged server (launchctl kickstart -k,
    systemctl restart, a signal, a command): SIGUSR1 for its stacks, a short
    wait, a `wedged` report; then the real action. The report never blocks
    the restart."""

    def __init__(self, action: RestartAction, instance: InstanceConfig,
                 locator: Optional[ProcessLocator]):
        self.action = action
        self.instance = instance
        self.locator = locator
        self.report_dir = reports.report_dir(instance.report_dir)
        self.last_report: Optional[str] = None

    def __str__(self) -> str:
        return str(self.action)

    def _pids(self) -> List[int]:
        pids: List[int] = []
        if self.instance.heartbeat_file:
            beat = read_heartbeat(self.instance.heartbeat_file)
            if beat is not None:
                pids.append(beat.pid)
        if self.locator is not None:
            try:
                pid = self.locator.find().pid
                if pid not in pids:
                    pids.append(pid)
            except Exception:  # noqa: BLE001 - no process to ask: no stacks
                pass
        return pids

    def restart_planned(self, reason: str) -> ActionResult:
        """A planned restart: nothing is wrong, so no stacks; the action drains."""
        return restart_planned(self.action, reason)

    def restart(self, reason: str) -> ActionResult:
        try:
            pids = self._pids()
            if pids:
                path = reports.capture_stacks(
                    pids, reason=reason, directory=self.report_dir,
                    heartbeat_file=self.instance.heartbeat_file,
                    extra={"instance": self.instance.name})
                self.last_report = str(path) if path else None
        except Exception:  # noqa: BLE001 - evidence never blocks the restart
            pass
        return self.action.restart(reason)


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


def build_monitor(
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
        for monitor in self.monitors.values():
            if monitor.state is not None:
                monitor.state.flush()
        return 0

    def _loop(self, name: str, monitor: Monitor, interval: float) -> None:
        wake = self._wakes[name]
        monitor.started()
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                monitor.tick()
            except Exception:  # noqa: BLE001 - a bug in one monitor must not silence the others
                monitor.events.exception("error", "tick failed")
            wake.wait(max(0.0, interval - (time.monotonic() - began)))
            wake.clear()
