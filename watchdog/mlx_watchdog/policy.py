"""Policy: when a restart may happen. Boot grace, backoff, crash-loop state.

Decisions only: the judge says *whether* a server needs a restart, this says
*when*, and the actions (act.py) only restart. Pure: every method takes `now`
(monotonic seconds), so tests drive it with numbers.

Like Kubernetes' CrashLoopBackOff, but quicker to recover and never a reason
to stop: a server that is down for good is the outage we exist to end.

- Boot grace: after each start, failures do not count for `boot_grace_s` (or
  until the first good probe, or until the heartbeat says the new server is
  loaded and serving: `end_grace`, whichever comes first).
- Backoff is for starts that never serve (a crash loop): after n restarts
  whose servers never served, the next waits `backoff_initial_s * 2**(n-1)`,
  at most `backoff_max_s`, counted from when the restart was first wanted
  (the exit, or the wedged verdict). Restarts are never paused longer than
  the cap.
- Served: a start that reached serving (a good probe of it, or its own
  heartbeat saying it delivered) ends the run of failures: `served`. The next
  restart is immediate, however often the server died before. A server that
  dies once a minute and serves in between is restarted at once each time (a
  restart costs seconds), not after 4, 8, 16... s.
- Crash-looping: `max_restarts` or more restarts within `window_s`, served
  or not. It is a state to show in logs, metrics and status; restarts go on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, Optional

from . import defaults


@dataclass(frozen=True)
class RestartDecision:
    allowed: bool
    crash_looping: bool = False
    wait_s: float = 0.0
    reason: str = ""


class RestartPolicy:
    def __init__(
        self,
        *,
        boot_grace_s: float = defaults.BOOT_GRACE_S,
        backoff_initial_s: float = defaults.BACKOFF_INITIAL_S,
        backoff_max_s: float = defaults.BACKOFF_MAX_S,
        max_restarts: int = defaults.MAX_RESTARTS,
        window_s: float = defaults.RESTART_WINDOW_S,
    ):
        if backoff_max_s < 0 or backoff_initial_s < 0:
            raise ValueError("backoff times must not be negative")
        self.boot_grace_s = boot_grace_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._grace_until: Optional[float] = None
        self._restarts: Deque[float] = deque()  # within window_s, for the crash-loop state
        self._in_a_row = 0  # restarts since a start last served
        self._wanted_since: Optional[float] = None  # a restart is wanted, since then
        # Set while the instance needs attention (attention.py): a restart
        # cannot fix what kills it, so every wait is the cap, never longer.
        self.at_cap = False

    # -- what happened -------------------------------------------------------

    def started(self, now: float) -> None:
        """A server process (re)started now: its boot grace begins."""
        self._grace_until = now + self.boot_grace_s

    def end_grace(self, now: float) -> None:
        """The new server is loaded and serving (its heartbeat says so):
        failures count from now on, before any probe has succeeded."""
        self._grace_until = None

    def healthy(self, now: float) -> None:
        """A probe of the current server succeeded: the boot is over, and
        this start served."""
        self._grace_until = None
        self._wanted_since = None
        self.served(now)

    def served(self, now: float) -> None:
        """The current server delivered (a good probe, or its own heartbeat
        says so): it was no crash loop, the next restart is immediate."""
        self._in_a_row = 0

    def record_restart(self, now: float) -> None:
        """A restart was attempted now (successful or not: both count)."""
        self._restarts.append(now)
        self._in_a_row += 1
        self._wanted_since = None
        self.started(now)

    # -- questions -------------------------------------------------------------

    def in_grace(self, now: float) -> bool:
        return self._grace_until is not None and now < self._grace_until

    @property
    def restarts_in_a_row(self) -> int:
        return self._in_a_row

    def backoff_s(self) -> float:
        """The wait before the next restart, counted from when it was wanted."""
        if self._in_a_row == 0:
            return 0.0
        if self.at_cap:
            return self.backoff_max_s
        exponent = min(self._in_a_row - 1, 62)  # 2**62 s is forever; avoid overflow
        return min(self.backoff_initial_s * 2**exponent, self.backoff_max_s)

    def crash_looping(self, now: float) -> bool:
        while self._restarts and self._restarts[0] <= now - self.window_s:
            self._restarts.popleft()
        return len(self._restarts) >= self.max_restarts

    def check(self, now: float) -> RestartDecision:
        """May we restart now? The first call of an episode starts its clock."""
        if self._wanted_since is None:
            self._wanted_since = now
        looping = self.crash_looping(now)
        loop_note = (
            f"crash-looping: {len(self._restarts)} restarts in {self.window_s:g}s"
            if looping else ""
        )
        wait = self._wanted_since + self.backoff_s() - now
        if wait > 0:
            reason = f"restart in {wait:.0f}s (backoff {self.backoff_s():g}s)"
            if loop_note:
                reason = f"{loop_note}; {reason}"
            return RestartDecision(False, crash_looping=looping, wait_s=wait, reason=reason)
        return RestartDecision(True, crash_looping=looping, reason=loop_note)
