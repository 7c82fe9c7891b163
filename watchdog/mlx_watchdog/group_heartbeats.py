"""Every rank's heartbeat: rank N>0 writes `<file>.rankN` (the contract's
rank_file); GroupHeartbeat hands the judge the worst one."""

from __future__ import annotations

import contextlib
import glob
import os
from typing import Dict, List, Optional

from . import contract
from .heartbeat import HeartbeatReading, HeartbeatTracker, read_record


def rank_heartbeat_files(path: "str | os.PathLike[str]") -> List[str]:
    """The heartbeat files of ranks N>0 next to rank 0's (`<path>.rankN`, the
    contract's rank_file)."""
    pattern = glob.escape(str(path)) + ".rank*"
    return sorted(p for p in glob.glob(pattern) if contract.RANK_FILE.search(p))


def clear_heartbeats(path: "str | os.PathLike[str]") -> None:
    """Remove every rank's heartbeat (a new group starts): an old one would look stale."""
    for file in [str(path), *rank_heartbeat_files(path)]:
        with contextlib.suppress(OSError):
            os.unlink(file)


class GroupHeartbeat:
    """A HeartbeatTracker over every rank's file; sample() returns the worst.

    For a lone server only the one file exists and this is a HeartbeatTracker.
    The worst reading: a rank whose own record says it stalled, else the
    oldest beat. So a rank that stops beating makes the group's heartbeat
    stale, whatever the others do. Owned by one thread, as HeartbeatTracker;
    `accepted` covers every rank.
    """

    def __init__(self, path: "str | os.PathLike[str]", **tracker_options):
        self.path = path
        self._options = tracker_options
        self._trackers: Dict[str, HeartbeatTracker] = {}
        self.accepted: Dict[str, int] = {}

    def sample(self) -> Optional[HeartbeatReading]:
        return self.observe(read_record(self.path))

    def observe(self, record: Optional[dict]) -> Optional[HeartbeatReading]:
        """The worst reading, rank 0's from record (read by the caller), the
        other ranks' read here."""
        files = [str(self.path), *rank_heartbeat_files(self.path)]
        for file in files:
            if file not in self._trackers:
                self._trackers[file] = HeartbeatTracker(file, **self._options)
        rank0, *others = self._trackers.values()
        readings = [r for r in (rank0.observe(record), *(t.sample() for t in others))
                    if r is not None]
        accepted: Dict[str, int] = {}
        for tracker in self._trackers.values():
            accepted.update(tracker.accepted)
        self.accepted = accepted
        if not readings:
            return None
        return max(readings, key=lambda r: (r.phase not in ("loading", "serving"), r.age_s))

    @property
    def problem(self) -> Optional[str]:
        """Why a rank's heartbeat was not used, if one was not (the first found)."""
        problems = [t.problem for t in self._trackers.values() if t.problem]
        return problems[0] if problems else None

    def reset(self) -> None:
        self._trackers.clear()
        self.accepted = {}


def heartbeat_tracker(path: "str | os.PathLike[str]", **options) -> GroupHeartbeat:
    return GroupHeartbeat(path, **options)
