"""Throughput from the shim's heartbeat counters, and crash reports in a folder.

The shim's heartbeat file (see heartbeat.py) also carries per-process counters
(contract.HEARTBEAT_FIELDS): prompt_tokens (prompt-progress deliveries),
decode_tokens (generated tokens), requests, cancelled, and the in_flight
gauge; with the admission part also rejected_queue_full,
rejected_queue_timeout and deadline_stops, and the queued and running
gauges (requests waiting for a slot, requests generating). The server
counts them anyway; the watchdog reads them from the file it already reads,
so nothing is added on the server's per-token path.

Those counters start again at zero in every new server process. Prometheus
counters must only grow, so `CounterTotals` turns them into totals that
survive restarts: a new pid, or a counter that went backwards, is a new
process whose whole count is new.

Older shims write no counters; every field is optional.
"""

from __future__ import annotations

import collections
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Deque, Dict, Mapping, Optional, Tuple

from . import contract

# heartbeat field -> what we call it (metric names, the status record)
COUNTERS = {
    "prompt_tokens": "prefill_tokens",
    "decode_tokens": "decode_tokens",
    "requests": "requests",
    "cancelled": "cancelled_requests",
    "rejected_queue_full": "rejected_queue_full",
    "rejected_queue_timeout": "rejected_queue_timeout",
    "deadline_stops": "deadline_stops",
}
RATE_WINDOW_S = 60.0  # tok/s in `status` is the mean over about this long


def _count(value: object) -> Optional[int]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        return None
    return int(value)


class CounterTotals:
    """Monotonic totals from counters that restart at zero with each process."""

    def __init__(self) -> None:
        self._pid: object = None
        self._last: Dict[str, int] = {}
        self._first = True
        self.totals: Dict[str, int] = {name: 0 for name in COUNTERS.values()}

    def update(self, pid: object, counters: Mapping[str, int]) -> Dict[str, int]:
        """Add what the process counted since the last update; returns the increments."""
        restarted = not self._first and pid != self._pid
        self._first, self._pid = False, pid
        if restarted:
            self._last = {}
        increments = {}
        for name, value in counters.items():
            last = self._last.get(name)
            if restarted:
                delta = value  # a new process counted from zero: all of it is new
            elif last is None:
                # The first reading is the baseline, not new work: a watchdog
                # started next to a long-running server must not report that
                # server's whole history as one burst.
                delta = 0
            elif value < last:
                delta = value  # the process reset its counters
            else:
                delta = value - last
            self._last[name] = value
            if delta:
                self.totals[name] += delta
                increments[name] = delta
        return increments


@dataclass
class ThroughputReading:
    pid: object
    phase: Optional[str]
    in_flight: Optional[int]
    increments: Dict[str, int]  # what to add to each counter this tick
    rates: Dict[str, Optional[float]]  # per second over RATE_WINDOW_S; None: not yet known
    last_delivery: Optional[float] = None
    queued: Optional[int] = None  # waiting for a slot (admission part)
    running: Optional[int] = None  # generating


class ThroughputTracker:
    """The heartbeat's counters, observed each tick; keeps totals and recent
    rates. The monitor reads the heartbeat file once per tick
    (heartbeat.read_record) for this and the HeartbeatTracker both."""

    def __init__(
        self,
        *,
        window_s: float = RATE_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.window_s = window_s
        self._clock = clock
        self.totals = CounterTotals()
        self._history: Deque[Tuple[float, Dict[str, int]]] = collections.deque()
        self.last: Optional[ThroughputReading] = None

    def observe(self, record: Optional[Mapping[str, object]]) -> Optional[ThroughputReading]:
        """The reading of one heartbeat record (None: no file, nothing to add)."""
        if record is None:
            return None
        counters = {
            ours: value
            for theirs, ours in COUNTERS.items()
            if (value := _count(record.get(theirs))) is not None
        }
        now = self._clock()
        increments = self.totals.update(record.get("pid"), counters)
        self._history.append((now, dict(self.totals.totals)))
        while len(self._history) > 2 and now - self._history[1][0] >= self.window_s:
            self._history.popleft()
        first_at, first = self._history[0]
        span = now - first_at
        rates: Dict[str, Optional[float]] = {}
        for name in COUNTERS.values():
            known = name in counters and span > 0
            rates[name] = (self.totals.totals[name] - first[name]) / span if known else None
        phase = record.get("phase")
        last_delivery = record.get("last_delivery")
        self.last = ThroughputReading(
            pid=record.get("pid"),
            phase=phase if isinstance(phase, str) else None,
            in_flight=_count(record.get("in_flight")),
            increments=increments,
            rates=rates,
            last_delivery=last_delivery if isinstance(last_delivery, (int, float)) else None,
            queued=_count(record.get("queued")),
            running=_count(record.get("running")),
        )
        return self.last


@dataclass
class ReportScan:
    new: int  # reports that appeared since the previous scan
    newest: Optional[str] = None  # file name of the newest report
    newest_time: Optional[float] = None  # its mtime


class ReportWatcher:
    """Counts crash reports (report names: contract.REPORT_NAME) appearing in
    a folder: those of one instance when `instance` is given (several
    instances may share a folder).

    A report names its instance (`instance`: name, port, model; see
    reports.instance_field and the shim's reports.instance()): it is ours
    when its name is ours, or, without a name, when its port is ours. A
    report that names no instance at all is counted only when no instance
    is given. Reports already there when the watchdog starts are not new;
    the newest one is still shown by `status`.
    """

    def __init__(self, folder: "str | os.PathLike[str]", instance: Optional[str] = None,
                 port: Optional[int] = None):
        self.folder = Path(folder)
        self.instance = instance
        self.port = port
        self._seen: Optional[set] = None
        self._ours: Dict[str, bool] = {}  # file name -> is it this instance's
        self.newest: Optional[Tuple[float, str]] = None

    def scan(self) -> ReportScan:
        names = {}
        try:
            with os.scandir(self.folder) as entries:
                for entry in entries:
                    if contract.REPORT_NAME.match(entry.name):
                        try:
                            names[entry.name] = entry.stat().st_mtime
                        except OSError:
                            pass
        except OSError:  # no folder (yet): no reports
            pass
        names = {name: mtime for name, mtime in names.items() if self._is_ours(name)}
        new = 0 if self._seen is None else len(set(names) - self._seen)
        self._seen = set(names) if self._seen is None else self._seen | set(names)
        if names:
            name = max(names, key=lambda n: (names[n], n))
            self.newest = (names[name], name)
        newest_time, newest = self.newest if self.newest else (None, None)
        return ReportScan(new=new, newest=newest, newest_time=newest_time)

    def _is_ours(self, name: str) -> bool:
        if self.instance is None:
            return True
        if name not in self._ours:  # each file is read once
            self._ours[name] = belongs_to(_read_report(self.folder / name), self.instance,
                                          self.port)
        return self._ours[name]


def belongs_to(report: Optional[Mapping[str, object]], name: str,
               port: Optional[int] = None) -> bool:
    """Whether a report is instance name's (see ReportWatcher)."""
    if not isinstance(report, Mapping):
        return False
    instance = report.get("instance")
    if isinstance(instance, str):  # the watchdog's own reports before schema 1 had a name only
        return instance == name
    if not isinstance(instance, Mapping):
        return False
    if instance.get("name") is not None:
        return instance.get("name") == name
    return port is not None and instance.get("port") == port


def _read_report(path: Path) -> Optional[Dict[str, object]]:
    from .safefile import read_regular

    try:
        data = json.loads(read_regular(path, 1 << 23))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
