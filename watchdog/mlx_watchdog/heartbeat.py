"""Reading the hotfix shim's heartbeat file.

With MLX_HOTFIX_HEARTBEAT_FILE=/path in the server's environment, the shim
rewrites that file (atomically, at most once a second) each time the
generation loop iterates, busy or idle:

    {"pid": 123, "beats": 4567, "time": 1700000000.5, "phase": "serving"}

``beats`` only grows; ``phase`` is "loading" or "serving". When the loop hangs
the file stops changing, which is the most direct sign of a wedge there is.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

LOADING = "loading"
SERVING = "serving"
_MAX_BYTES = 4096


@dataclass(frozen=True)
class Heartbeat:
    pid: int
    beats: int
    time: float  # unix time of the write
    phase: str


@dataclass(frozen=True)
class HeartbeatReading:
    """What the judge gets: how old the heartbeat is and whether it moved."""

    age_s: float
    advanced: bool  # beats (or pid) changed since the previous reading
    phase: str
    beats: int
    pid: int


def read_heartbeat(path: "str | os.PathLike[str]") -> Optional[Heartbeat]:
    """The heartbeat in path, or None if the file is missing, partial or garbage."""
    try:
        with open(path, "rb") as handle:
            data = json.loads(handle.read(_MAX_BYTES))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    pid, beats, stamp, phase = (data.get(k) for k in ("pid", "beats", "time", "phase"))
    if not (_is_int(pid) and _is_int(beats) and isinstance(phase, str)):
        return None
    if not (_is_int(stamp) or isinstance(stamp, float)):
        return None
    return Heartbeat(pid=pid, beats=beats, time=float(stamp), phase=phase)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class HeartbeatTracker:
    """Reads the heartbeat each tick and remembers the last one to spot progress."""

    def __init__(
        self,
        path: "str | os.PathLike[str]",
        *,
        clock: Callable[[], float] = time.time,
        read: Callable[..., Optional[Heartbeat]] = read_heartbeat,
    ):
        self.path = path
        self._clock = clock
        self._read = read
        self._last: Optional[Heartbeat] = None

    def sample(self) -> Optional[HeartbeatReading]:
        beat = self._read(self.path)
        if beat is None:
            return None
        last, self._last = self._last, beat
        advanced = last is not None and (beat.pid, beat.beats) != (last.pid, last.beats)
        return HeartbeatReading(
            age_s=max(0.0, self._clock() - beat.time),
            advanced=advanced,
            phase=beat.phase,
            beats=beat.beats,
            pid=beat.pid,
        )

    def reset(self) -> None:
        """Forget the previous reading (the server was restarted)."""
        self._last = None
