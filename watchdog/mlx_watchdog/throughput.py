"""Throughput from the shim's heartbeat counters.

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
import time
from dataclasses import dataclass
from typing import Callable, Deque, Dict, Mapping, Optional, Tuple


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
