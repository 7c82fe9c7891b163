"""Policy: when restarting cannot fix a death, say so once, and keep going.

A server that dies of a class a restart cannot fix (a wrong --model, weights
that do not match the mlx-lm release, a known-bad mlx pair: the table in
signatures.py says which) on NEEDS_ATTENTION_STARTS starts in a row needs a
person. The watchdog then

- keeps restarting, at the backoff cap (never down for good still holds: the
  person may fix the model folder in place, and the next start serves);
- marks the instance **needs attention** (status, log, metric, alert) and says
  the remedy once per cause, not at every restart.

A start that serves, or a death a restart can fix, clears it.

Pure: decisions only, no clock, no I/O, so tests drive it with class names.
Kept apart from RestartPolicy (policy.py), which it only informs: the cap
comes from there, the cause from the death's class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Set

NEEDS_ATTENTION_STARTS = 3


@dataclass(frozen=True)
class NeedsAttention:
    cause: str  # the death class of the latest start
    remedy: str
    starts: int  # starts in a row that died of a class a restart cannot fix
    announce: bool  # say the remedy now: the first time for this cause

    def message(self) -> str:
        return (f"needs attention: {self.cause} on {self.starts} starts in a row, and a "
                f"restart cannot fix it; {self.remedy}")


def _default_cannot_fix(cause: str) -> bool:
    from .signatures import restart_cannot_fix

    return restart_cannot_fix(cause)


def _default_remedy(cause: str) -> str:
    from .signatures import entry

    return entry(cause).remedy


class AttentionTracker:
    """Counts the starts in a row that died of a class a restart cannot fix."""

    def __init__(self, starts: int = NEEDS_ATTENTION_STARTS, *,
                 cannot_fix: Optional[Callable[[str], bool]] = None,
                 remedy_for: Optional[Callable[[str], str]] = None):
        if starts < 1:
            raise ValueError("starts must be at least 1")
        self.starts = starts
        self._cannot_fix = cannot_fix or _default_cannot_fix
        self._remedy_for = remedy_for or _default_remedy
        self._in_a_row = 0
        self._said: Set[str] = set()  # causes whose remedy was said this episode
        self.current: Optional[NeedsAttention] = None

    def observe(self, cause: Optional[str]) -> Optional[NeedsAttention]:
        """A start ended in a death of this class. Needs attention, or None."""
        if not cause or not self._cannot_fix(cause):
            self.clear()
            return None
        self._in_a_row += 1
        if self._in_a_row < self.starts:
            return None
        announce = cause not in self._said
        self._said.add(cause)
        self.current = NeedsAttention(cause=cause, remedy=self._remedy_for(cause),
                                      starts=self._in_a_row, announce=announce)
        return self.current

    def served(self) -> None:
        """A start served (a good probe): whatever was wrong is fixed."""
        self.clear()

    def clear(self) -> None:
        self._in_a_row = 0
        self._said.clear()
        self.current = None

    def wait_s(self, backoff_wait_s: float, cap_s: float) -> float:
        """How long to wait before the next restart: the cap while attention
        is needed (a restart cannot fix it; no need to hurry), else the backoff's."""
        return max(backoff_wait_s, cap_s) if self.current is not None else backoff_wait_s
