"""In-process fakes for unit tests of the watchdog's own logic (no processes).

Mocks are for our own logic only (DEVELOPERS.md): anything about the real
server is tested against the real stock server (harness.server).
"""

from __future__ import annotations

from typing import List

from mlx_watchdog.act import ActionResult
from mlx_watchdog.process import ProcessSample


class Clock:
    """A clock the test moves by hand: set or add to ``now``."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeProcess:
    """Process evidence: alive, with the CPU seconds the test sets."""

    def __init__(self, cpu_s: float = 0.0) -> None:
        self.cpu_s = cpu_s
        self.resets = 0

    def sample(self, rescan=True) -> ProcessSample:
        return ProcessSample(alive=True, cpu_s=self.cpu_s, wall_s=5.0)

    def reset(self) -> None:
        self.resets += 1


class FakeAction:
    """A restart action that records its reasons and succeeds (or not)."""

    def __init__(self, ok: bool = True) -> None:
        self.ok = ok
        self.reasons: List[str] = []

    def restart(self, reason: str) -> ActionResult:
        self.reasons.append(reason)
        return ActionResult(self.ok, "did it" if self.ok else "launchctl: command not found")
