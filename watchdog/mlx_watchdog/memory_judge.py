"""The memory judge: decisions from the memory measured, pure logic, no I/O.

Each tick ``MemoryJudge.observe(now, measure, in_flight)`` (monotonic
seconds; the measure of memory.py; the heartbeat's requests in flight)
returns a ``MemoryDecision``. It decides; the caller acts.

- **Soft line**, ``soft_share`` (85%) of the limit: state ``memory_soft``.
  ``soft`` is set: keep the shim's /health at 503 ``{"status": "memory"}``
  so a balancer sends new work elsewhere; ``trim`` is set when the line is
  crossed and again every ``trim_repeat_s`` while above it: ask the shim for
  a trim. It clears when the measure falls under the soft line.
- **Hard line**, ``hard_share`` (95%): state ``memory_hard``, and a planned
  restart is wanted (trigger ``hard``).
- **The trend**: the least-squares slope of the samples of the last
  ``window_s`` (an hour) says the hard line is crossed within ``horizon_s``
  (6 h): a planned restart is wanted (trigger ``trend``). The fit needs
  ``trend_min_span_s`` of samples; and the fit of the window's later half
  must say so too, so memory that grew while a cache filled and has
  levelled off since (a healthy server warming up) is no leak.
- **When**: a wanted restart is taken (``restart``) at the first tick with
  nothing in flight, or once ``idle_wait_s`` (5 min) have passed since it
  was first wanted, whichever comes first; at or over the limit itself, at
  once. The restart is a planned one (drained); its cause is ``memory``.
  A wanted restart whose reason went away (a trim brought memory back under
  the hard line, the trend flattened) is no longer wanted.

``WiredWatch`` decides "reboot required" after a server ended: on macOS a
killed process holding a wired model can leak the wired memory until reboot
(jundot/omlx #2184, ml-explore/mlx #3910). If the machine's wired memory has
not fallen by at least half of what the old server held within
``window_s`` (a minute) of its end, the verdict is ``reboot-required``
(say so in the log, ``status``, a metric and an alert; ``hold_restarts``:
do not crash-loop into a machine with no memory). A later fall still clears it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, List, Optional, Sequence, Tuple

from . import contract
from .memory import GiB, format_bytes

OK = "ok"
MEMORY_SOFT = "memory_soft"
MEMORY_HARD = "memory_hard"
UNKNOWN = "unknown"  # no measure this tick
CAUSE = contract.MEMORY  # the restart cause (labels metrics, names the crash report kind)

SOFT_SHARE = 0.85
HARD_SHARE = 0.95
HORIZON_S = 6 * 3600.0
IDLE_WAIT_S = 300.0
WINDOW_S = 3600.0
TREND_MIN_SPAN_S = 900.0
TREND_MIN_SAMPLES = 10
TRIM_REPEAT_S = 600.0


@dataclass(frozen=True)
class MemoryGuardConfig:
    limit_bytes: int
    soft_share: float = SOFT_SHARE
    hard_share: float = HARD_SHARE
    horizon_s: float = HORIZON_S
    idle_wait_s: float = IDLE_WAIT_S
    window_s: float = WINDOW_S
    trend_min_span_s: float = TREND_MIN_SPAN_S
    trend_min_samples: int = TREND_MIN_SAMPLES
    trim_repeat_s: float = TRIM_REPEAT_S

    def __post_init__(self):
        if self.limit_bytes <= 0:
            raise ValueError("the memory limit must be positive")
        if not 0 < self.soft_share <= self.hard_share <= 1:
            raise ValueError("expected 0 < soft share <= hard share <= 1")

    @property
    def soft_line(self) -> float:
        return self.limit_bytes * self.soft_share

    @property
    def hard_line(self) -> float:
        return self.limit_bytes * self.hard_share


@dataclass(frozen=True)
class Trend:
    slope: float  # bytes per second (the smaller of the two fits)
    eta_s: Optional[float]  # seconds until the hard line (both fits agree), None: not rising
    span_s: float  # how much time the samples cover


@dataclass(frozen=True)
class MemoryDecision:
    state: str  # OK, MEMORY_SOFT, MEMORY_HARD or UNKNOWN
    reason: str
    measure: Optional[int] = None
    share: Optional[float] = None  # of the limit
    soft: bool = False  # keep /health at 503 "memory" (the request's soft_until)
    trim: bool = False  # ask the shim for a trim now
    restart: bool = False  # take the planned restart now
    restart_pending: bool = False  # wanted, waiting for a moment with nothing in flight
    trigger: str = ""  # "hard", "trend" or "limit" when a restart is wanted
    eta_s: Optional[float] = None  # the trend's time to the hard line, when rising
    cause: str = ""  # CAUSE when restart


def least_squares(points: Sequence[Tuple[float, float]]) -> Optional[Tuple[float, float]]:
    """(slope, intercept) of the least-squares line through points, or None."""
    n = len(points)
    if n < 2:
        return None
    mean_t = sum(t for t, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread <= 0:
        return None
    slope = sum((t - mean_t) * (y - mean_y) for t, y in points) / spread
    return slope, mean_y - slope * mean_t


def trend(samples: Sequence[Tuple[float, float]], now: float, hard_line: float, *,
          min_span_s: float = TREND_MIN_SPAN_S,
          min_samples: int = TREND_MIN_SAMPLES) -> Optional[Trend]:
    """Where the samples (time, bytes) are heading; None with too few of them.

    eta_s is the later of two crossings of the hard line: the whole window's
    fit, and the fit of its later half. A steady leak makes both cross; a
    curve that has levelled off has a flat later half and does not."""
    if len(samples) < min_samples:
        return None
    span = samples[-1][0] - samples[0][0]
    if span < min_span_s:
        return None
    middle = samples[-1][0] - span / 2
    recent = [p for p in samples if p[0] >= middle]
    fits = [least_squares(samples), least_squares(recent) if len(recent) >= 3 else None]
    if any(fit is None for fit in fits):
        return None
    slope = min(fit[0] for fit in fits)
    if slope <= 0:
        return Trend(slope, None, span)
    crossings = [max(0.0, (hard_line - (fit[0] * now + fit[1])) / fit[0]) for fit in fits]
    return Trend(slope, max(crossings), span)


class MemoryJudge:
    def __init__(self, config: MemoryGuardConfig):
        self.config = config
        self.reset()

    def reset(self) -> None:
        """A new server process: its samples start afresh."""
        self._samples: Deque[Tuple[float, float]] = deque()
        self._above_soft = False
        self._last_trim: Optional[float] = None
        self._wanted_since: Optional[float] = None

    def samples(self) -> List[Tuple[float, float]]:
        """(monotonic time, bytes) of the last window: the memory report's samples."""
        return list(self._samples)

    def observe(self, now: float, measure: Optional[int],
                in_flight: Optional[int] = None) -> MemoryDecision:
        config = self.config
        if measure is None:
            return MemoryDecision(UNKNOWN, "no memory measure this tick",
                                  restart_pending=self._wanted_since is not None)
        self._samples.append((now, float(measure)))
        while self._samples and self._samples[0][0] < now - config.window_s:
            self._samples.popleft()
        share = measure / config.limit_bytes
        level = f"{format_bytes(measure)} of {format_bytes(config.limit_bytes)} ({share:.0%})"

        trim = False
        if measure >= config.soft_line:
            if (not self._above_soft or self._last_trim is None
                    or now - self._last_trim >= config.trim_repeat_s):
                trim, self._last_trim = True, now
            self._above_soft = True
        else:
            self._above_soft, self._last_trim = False, None
        state = (MEMORY_HARD if measure >= config.hard_line
                 else MEMORY_SOFT if self._above_soft else OK)

        rising = trend(list(self._samples), now, config.hard_line,
                       min_span_s=config.trend_min_span_s,
                       min_samples=config.trend_min_samples)
        eta = rising.eta_s if rising is not None else None
        trigger, why = "", level
        if measure >= config.limit_bytes:
            trigger, why = "limit", f"{level}: at the limit"
        elif state == MEMORY_HARD:
            trigger, why = "hard", f"{level}: over the hard line ({config.hard_share:.0%})"
        elif eta is not None and eta <= config.horizon_s:
            trigger = "trend"
            why = (f"{level}, rising {format_bytes(int(rising.slope * 3600))}/h: the hard line "
                   f"({config.hard_share:.0%}) in {eta / 3600:.1f} h, within the "
                   f"{config.horizon_s / 3600:g} h horizon")
        elif state == MEMORY_SOFT:
            why = f"{level}: over the soft line ({config.soft_share:.0%})"
        common = dict(measure=measure, share=share, soft=self._above_soft, trim=trim, eta_s=eta)
        if not trigger:
            self._wanted_since = None
            return MemoryDecision(state, why, **common)
        if self._wanted_since is None:
            self._wanted_since = now
        waited = now - self._wanted_since
        if trigger == "limit" or in_flight == 0 or waited >= config.idle_wait_s:
            when = ("at once" if trigger == "limit" else "nothing in flight" if in_flight == 0
                    else f"no idle moment in {config.idle_wait_s:g}s")
            return MemoryDecision(state, f"{why}; planned restart ({when})", restart=True,
                                  trigger=trigger, cause=CAUSE, **common)
        waiting = "requests in flight" if in_flight else "requests in flight unknown"
        return MemoryDecision(
            state, f"{why}; planned restart at the first idle moment ({waiting}; at most "
                   f"{config.idle_wait_s - waited:.0f}s more)",
            restart_pending=True, trigger=trigger, **common)


# -- after a restart: did the wired memory come back? ------------------------------------

RELEASED = "released"
WAITING = "waiting"
REBOOT_REQUIRED = "reboot-required"
WIRED_UNKNOWN = "unknown"
WIRED_WINDOW_S = 60.0
WIRED_SHARE = 0.5  # at least this share of what the old server held must come back
WIRED_MIN_HELD = 1 * GiB  # below this, other processes' wiring drowns the signal


@dataclass(frozen=True)
class WiredVerdict:
    state: str  # RELEASED, WAITING, REBOOT_REQUIRED or WIRED_UNKNOWN
    reason: str

    @property
    def hold_restarts(self) -> bool:
        """A machine whose memory is gone until reboot: a new server would be
        killed for memory again, so do not restart it into that in a loop."""
        return self.state == REBOOT_REQUIRED


class WiredWatch:
    """Watches the machine's wired memory after a server process ended."""

    def __init__(self, *, window_s: float = WIRED_WINDOW_S, share: float = WIRED_SHARE,
                 min_held: int = WIRED_MIN_HELD):
        self.window_s, self.share, self.min_held = window_s, share, min_held
        self._ended: Optional[float] = None
        self._target: Optional[float] = None
        self._held = 0
        self._verdict = WiredVerdict(WIRED_UNKNOWN, "no server has ended yet")

    def server_ended(self, now: float, *, wired_before: Optional[int],
                     held: Optional[int]) -> None:
        """A server ended at now. wired_before: the machine's wired memory while
        it ran (the last reading before the end); held: what it had wired (its
        rusage ri_wired_size, else its mlx_active)."""
        self._ended = now
        if wired_before is None or held is None or held < self.min_held:
            self._target = None
            what = "unknown" if held is None else format_bytes(held)
            self._verdict = WiredVerdict(
                WIRED_UNKNOWN, f"the old server held {what} of wired memory: too little to "
                               "tell, or no reading")
            return
        self._held = held
        self._target = wired_before - self.share * held
        self._verdict = WiredVerdict(WAITING, "waiting for the wired memory to come back")

    def observe(self, now: float, wired: Optional[int]) -> WiredVerdict:
        if self._ended is None or self._target is None:
            return self._verdict
        if wired is not None and wired <= self._target:
            self._verdict = WiredVerdict(
                RELEASED, f"wired memory back to {format_bytes(wired)} after the old server ended")
        elif self._verdict.state != RELEASED and now - self._ended >= self.window_s:
            now_text = "unknown" if wired is None else format_bytes(wired)
            self._verdict = WiredVerdict(
                REBOOT_REQUIRED,
                f"reboot required: the machine's wired memory ({now_text}) did not fall back "
                f"within {self.window_s:g}s of the old server's end (it held "
                f"{format_bytes(self._held)}); a killed process holding a wired model can "
                "leak it until reboot (jundot/omlx #2184)")
        return self._verdict
