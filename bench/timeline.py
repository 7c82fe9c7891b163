"""Steady client traffic through a fault, request by request, for the plots.

A figure that shows a fault (a death, a hang, a livelock, a planned restart)
runs ``Traffic`` against the server (or the supervisor's port) from a few
seconds before the fault until some seconds after it served again, on each
side it compares (stock and ours). Each client thread sends one short
completion after another and records when it was sent, when it ended and
whether it was answered 200 with a completion. ``timeline(zero)`` gives the
records relative to the fault, the shape bench/plots.py draws:

    results["timelines"][key] = {
        "title": "...", "zero": "death",              # what t = 0 is
        "arms": {"stock": {"requests": [[sent, done, ok], ...],
                           "events": [[t, "restarted"], ...],
                           "held": [[from, to], ...]},    # no traffic sent
                 "ours": {...}},
    }

Times are wall-clock (time.time()) seconds from the fault, rounded to ms.
"""

from __future__ import annotations

import threading
import time
from typing import Dict, List, Optional, Sequence

import requests

from harness.procs import chat_body

LEAD_S = 4.0  # traffic before the fault: the "before" of every plot


class Traffic:
    """clients threads, each sending one short completion after another."""

    def __init__(self, url: str, *, clients: int = 2, max_tokens: int = 4,
                 timeout: float = 10.0, gap_s: float = 0.05, **extra):
        self.url = url
        self.clients = clients
        self.payload = chat_body("count to ten", max_tokens=max_tokens, **extra)
        self.timeout = timeout
        self.gap_s = gap_s
        self.records: List[List[Optional[float]]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._go = threading.Event()
        self._go.set()
        self._in_flight = 0
        self._idle = threading.Condition(self._lock)
        self._threads: List[threading.Thread] = []
        self._held: List[List[Optional[float]]] = []  # [from, to] while hold() kept it off

    def start(self) -> "Traffic":
        for i in range(self.clients):
            thread = threading.Thread(target=self._run, name=f"traffic-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _run(self) -> None:
        session = requests.Session()
        while not self._stop.is_set():
            self._go.wait()
            if self._stop.is_set():
                break
            with self._lock:
                self._in_flight += 1
            sent = time.time()
            ok = False
            try:
                response = session.post(f"{self.url}/v1/chat/completions", json=self.payload,
                                        timeout=(1.0, self.timeout))
                ok = response.status_code == 200 and bool(response.json().get("choices"))
            except (requests.RequestException, ValueError):
                session.close()
                session = requests.Session()  # a broken connection is not reused
            done = time.time()
            with self._lock:
                self.records.append([sent, done, ok])
                self._in_flight -= 1
                self._idle.notify_all()
            # A refused connection fails at once: do not spin on a restarting port.
            self._stop.wait(self.gap_s if ok else max(self.gap_s, 0.1))

    def hold(self, timeout: Optional[float] = None) -> None:
        """Send nothing new and wait for the requests in flight (a fault that
        needs the server to itself, such as the `extend` crash pair)."""
        self._go.clear()
        self._held.append([time.time(), None])
        with self._lock:
            self._idle.wait_for(lambda: self._in_flight == 0,
                                self.timeout + 2 if timeout is None else timeout)

    def release(self) -> None:
        if self._held and self._held[-1][1] is None:
            self._held[-1][1] = time.time()
        self._go.set()

    def stop(self) -> None:
        self._stop.set()
        self._go.set()
        for thread in self._threads:
            thread.join(self.timeout + 5)

    def timeline(self, zero: float, events: Sequence = ()) -> Dict[str, list]:
        """The records (and (time, label) events) relative to zero, for the json."""
        with self._lock:
            records = list(self.records)
        return {
            "requests": [[round(s - zero, 3), round(d - zero, 3), bool(ok)]
                         for s, d, ok in sorted(records)],
            "events": [[round(t - zero, 3), label] for t, label in events if t is not None],
            "held": [[round(a - zero, 3), round((b or time.time()) - zero, 3)]
                     for a, b in self._held],
        }
