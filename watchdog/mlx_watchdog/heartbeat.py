"""Reading the hotfix shim's heartbeat file.

With MLX_HOTFIX_HEARTBEAT_FILE=/path in the server's environment, the shim
rewrites that file (atomically, at most once a second) each time the
generation loop iterates, busy or idle:

    {"pid": 123, "started": 1699999000.1, "beats": 4567, "time": 1700000000.5,
     "phase": "serving", "in_flight": 2, "delivered": 90123,
     "last_delivery": 1700000000.4, ...}

``beats`` only grows; ``phase`` is "loading", "serving" or "stalled" (requests
in flight and nothing delivered for the shim's MLX_HOTFIX_STALL_TIMEOUT). When
the loop hangs the file stops changing, which is the most direct sign of a
wedge there is. ``warning`` (present only then) is the shim's one line
about a known-bad install (a pair that dies on the first request, a yanked
release). Older shims write only pid, beats, time and phase: every
other field is optional.
"""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

from . import contract
from .safefile import read_regular

LOADING, SERVING, STALLED = contract.LOADING, contract.SERVING, contract.STALLED
_MAX_BYTES = 4096


@dataclass(frozen=True)
class Heartbeat:
    pid: int
    beats: int
    time: float  # unix time of the write
    phase: str
    started: Optional[float] = None  # unix time the shim started in that process
    in_flight: Optional[int] = None
    delivered: Optional[int] = None
    warning: Optional[str] = None  # the shim's known-bad-install line, if any


@dataclass(frozen=True)
class HeartbeatReading:
    """What the judge gets: how old the heartbeat is, and its phase."""

    age_s: float  # seconds since the last beat (see HeartbeatTracker)
    phase: str
    beats: int
    pid: int
    started: Optional[float] = None
    in_flight: Optional[int] = None
    warning: Optional[str] = None
    delivered: Optional[int] = None  # tokens this process delivered to clients


def read_record(path: "str | os.PathLike[str]") -> Optional[Dict[str, Any]]:
    """The heartbeat file as a dict, or None if missing, partial or garbage.

    Read as safefile reads: the folder may belong to the server's user, and
    a link or a FIFO planted there must neither be followed nor block us.
    """
    try:
        data = json.loads(read_regular(path, _MAX_BYTES))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_heartbeat(path: "str | os.PathLike[str]") -> Optional[Heartbeat]:
    """The heartbeat in path, or None if the file is missing, partial or garbage."""
    return parse_heartbeat(read_record(path))


def parse_heartbeat(data: Optional[Dict[str, Any]]) -> Optional[Heartbeat]:
    """The heartbeat in a record read by read_record (None: none in it)."""
    if not isinstance(data, dict):
        return None
    pid, beats, stamp, phase = (data.get(k) for k in contract.HEARTBEAT_REQUIRED)
    if not (_is_int(pid) and _is_int(beats) and isinstance(phase, str)):
        return None
    if not _is_number(stamp):
        return None
    started, in_flight, delivered = (data.get(k) for k in ("started", "in_flight", "delivered"))
    return Heartbeat(
        pid=pid, beats=beats, time=float(stamp), phase=phase,
        started=float(started) if _is_number(started) else None,
        in_flight=in_flight if _is_int(in_flight) else None,
        delivered=delivered if _is_int(delivered) else None,
        warning=_text(data.get("warning")),
    )


def path_problem(path: "str | os.PathLike[str]") -> Optional[str]:
    """Why the shim could not write, or we could not read, a heartbeat at path
    (None when the path is usable; a file not written yet is fine)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        return f"heartbeat file {path}: its directory {directory} does not exist"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"heartbeat file {path}: {exc.strerror or exc}"
    if not stat.S_ISREG(mode):
        return f"heartbeat file {path} is not a regular file"
    if not os.access(path, os.R_OK):
        return f"heartbeat file {path} cannot be read"
    return None


def not_from(beat: Heartbeat, root_pid: int) -> Optional[str]:
    """Why beat is no evidence about the process root_pid (None: it is).

    It must come from that process or one of its descendants (a server run
    through a wrapper), and be newer than the writer's start: a file from
    another process, or from before a reused pid started, says nothing.
    """
    try:
        import psutil
    except ImportError:
        return None
    try:
        writer = psutil.Process(beat.pid)
        started = writer.create_time()
        lineage = {beat.pid} | {p.pid for p in writer.parents()}
    except psutil.NoSuchProcess:
        if beat.pid == root_pid:
            return None  # the judged process itself: whether it runs is other evidence
        return f"heartbeat from pid {beat.pid}, which is not running (the server is pid {root_pid})"
    except psutil.Error:
        return None  # cannot look: do not discard
    if root_pid not in lineage:
        return f"heartbeat from pid {beat.pid}, not the server (pid {root_pid}) or its child"
    if beat.time < started - 1.0:
        return (f"heartbeat written {started - beat.time:.0f}s before its process "
                f"(pid {beat.pid}) started")
    return None


def _text(value: object) -> Optional[str]:
    """A one-line text field, safe to print, or None."""
    if not isinstance(value, str) or not value.strip():
        return None
    from .redact import printable

    return printable(" ".join(value.split()))[:600]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return _is_int(value) or isinstance(value, float)


class HeartbeatTracker:
    """Reads the heartbeat each tick and remembers the last one to spot progress.

    The age is the file's own timestamp (`clock() - time`), kept within what
    the tracker saw itself on its monotonic clock: a beat it has seen unchanged
    since time S is at least `now - S` old, and a beat that was not there at
    the read before (time B) is at most `now - B` old. So a hang is seen as
    soon as the timestamp says so, even when the last beats came in just after
    the previous read, and a wall clock that jumps moves the age by at most
    the time between two reads.

    One thread owns a tracker: the monitor's, which samples and resets it.
    Any other thread (the probe's give-up check) reads the file itself and
    looks only at `accepted`: {path: pid} of the writer the owner last took
    as the judged process, a dict replaced whole, never changed in place.
    """

    def __init__(
        self,
        path: "str | os.PathLike[str]",
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        read: Callable[..., Optional[Dict[str, Any]]] = read_record,
        owner: Optional[Callable[[], Optional[int]]] = None,
    ):
        self.path = path
        self._owner = owner  # the judged process's pid, for not_from()
        self.problem: Optional[str] = None  # why the last beat was not used, if not
        self._clock = clock
        self._monotonic = monotonic
        self._read = read
        self.reset()

    def sample(self) -> Optional[HeartbeatReading]:
        """Read the file and observe it."""
        return self.observe(self._read(self.path))

    def observe(self, record: Optional[Dict[str, Any]]) -> Optional[HeartbeatReading]:
        """The reading of a record the caller read (read_record) from the file."""
        beat = parse_heartbeat(record)
        now = self._monotonic()
        last, read_before = self._last, self._read_at
        self._read_at = now
        beat, self.problem = self._judged(beat)
        self.accepted = {} if beat is None else {os.fspath(self.path): beat.pid}
        if beat is None:
            return None
        self._last = beat
        advanced = last is not None and (beat.pid, beat.beats) != (last.pid, last.beats)
        if last is None or advanced:
            self._first_seen, self._absent_at = now, read_before
        age = max(0.0, self._clock() - beat.time, now - self._first_seen)
        if self._absent_at is not None:
            age = min(age, now - self._absent_at)
        return HeartbeatReading(
            age_s=age,
            phase=beat.phase,
            beats=beat.beats,
            pid=beat.pid,
            started=beat.started,
            in_flight=beat.in_flight,
            warning=beat.warning,
            delivered=beat.delivered,
        )

    def _judged(self, beat: Optional[Heartbeat]):
        """(beat, None) when it is evidence about the judged process, else (None, why)."""
        if beat is None:
            return None, path_problem(self.path)
        if self._owner is None:
            return beat, None
        try:
            root = self._owner()
        except Exception as exc:  # noqa: BLE001 - e.g. ProcessNotFound
            return None, f"heartbeat ignored: {exc}"
        if root is None:
            return beat, None
        why = not_from(beat, root)
        return (beat, None) if why is None else (None, f"{why}; ignored")

    def reset(self) -> None:
        """Forget the previous reading (the server was restarted)."""
        self.accepted: Dict[str, int] = {}
        self._last: Optional[Heartbeat] = None
        self._read_at: Optional[float] = None  # monotonic time of the previous read
        self._first_seen = 0.0  # when the current beat was first read
        self._absent_at: Optional[float] = None  # the read before that, when it was not there
