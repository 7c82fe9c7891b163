"""Finding the server process and measuring its CPU time (psutil).

Both restart-by-signal (act.SignalRestart) and the judge's CPU evidence need
to find the server from a pid, a pidfile or a command-line pattern.
`ProcessTable` is the slice of psutil used here; tests pass a fake.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import psutil

from .safefile import read_regular


class ProcessNotFound(Exception):
    """The process could not be found; the message says why."""


class AmbiguousProcess(ProcessNotFound):
    """More than one process matches: which is the server is unknown, which
    is not the same as "not running" (nothing to restart for)."""


class ProcessTable:
    """The real process table: psutil.Process objects."""

    def get(self, pid: int) -> Optional[psutil.Process]:
        try:
            return psutil.Process(pid)
        except psutil.Error:
            return None

    def all(self) -> Iterable[psutil.Process]:
        return psutil.process_iter()

    def wait_gone(self, procs: List[psutil.Process], timeout: float) -> List[psutil.Process]:
        """Wait up to timeout for procs to exit; return those still alive."""
        _, alive = psutil.wait_procs(procs, timeout=timeout)
        return alive


class ProcessLocator:
    """Finds one process from exactly one of pid, pidfile or match.

    match is a regular expression searched in the space-joined command line.
    More than one match is an error, never a guess: we are about to kill it.
    """

    def __init__(
        self,
        pid: Optional[int] = None,
        pidfile: Optional[str] = None,
        match: Optional[str] = None,
        *,
        table: Optional[ProcessTable] = None,
    ):
        if sum(x is not None for x in (pid, pidfile, match)) != 1:
            raise ValueError("give exactly one of pid, pidfile or match")
        self.pid, self.pidfile, self.match = pid, pidfile, match
        self._pattern = re.compile(match) if match is not None else None
        self.table = table or ProcessTable()
        self._last = None

    def __str__(self) -> str:
        if self.pid is not None:
            return f"pid {self.pid}"
        if self.pidfile is not None:
            return f"pidfile {self.pidfile}"
        return f"process matching {self.match!r}"

    def find(self):  # -> psutil.Process (or the fake's equivalent)
        """The process, or raise ProcessNotFound saying why not."""
        if self._pattern is not None:
            return self._find_by_match()
        pid = self.pid if self.pid is not None else self._read_pidfile()
        proc = self.table.get(pid)
        if proc is None:
            raise ProcessNotFound(f"no process with pid {pid}")
        return proc

    def find_cached(self):
        """Like find(), but keeps a process found by match while it runs.

        Matching reads the command line of every process on the machine:
        fine before a restart, too dear on every tick.
        """
        if self._pattern is None:
            return self.find()
        last = self._last
        try:
            if last is not None and last.is_running():
                return last
        except psutil.Error:
            pass
        self._last = self.find()
        return self._last

    def _read_pidfile(self) -> int:
        assert self.pidfile is not None
        try:
            # The server's user may write its folder: no link, no FIFO.
            text = read_regular(self.pidfile, 64).decode(errors="replace").strip()
        except OSError as exc:
            raise ProcessNotFound(f"cannot read pidfile {self.pidfile}: {exc.strerror}") from None
        if not text.isdigit() or int(text) <= 0:
            raise ProcessNotFound(f"pidfile {self.pidfile} does not hold a pid: {text[:20]!r}")
        return int(text)

    def _find_by_match(self):
        assert self._pattern is not None
        me = os.getpid()
        found = []
        for proc in self.table.all():
            try:
                if proc.pid == me:
                    continue
                if self._pattern.search(" ".join(proc.cmdline())):
                    found.append(proc)
            except (psutil.Error, OSError):
                continue  # gone, or not ours to read
        if not found:
            raise ProcessNotFound(f"no process matches {self.match!r}")
        if len(found) > 1:
            pids = ", ".join(str(p.pid) for p in found[:10])
            raise AmbiguousProcess(
                f"ambiguous: {len(found)} processes match {self.match!r} (pids {pids}); "
                "make the pattern match only the server"
            )
        return found[0]


TERMINATED, KILLED, SURVIVED = "terminated", "killed", "survived"


def terminate_with_grace(
    send: Callable[[int], None],
    gone_within: Callable[[float], bool],
    grace_s: float,
    *,
    first: Optional[int] = signal.SIGTERM,
    kill_wait_s: float = 10.0,
) -> str:
    """Stop a process (or a process group): `first` (None: it was sent
    already), up to grace_s for it to go, then SIGKILL and up to kill_wait_s.

    send(sig) must make sig count: after any signal but SIGKILL also SIGCONT,
    for a stopped process acts on a signal only once continued (as systemd
    does). gone_within(t) waits up to t seconds; True once it is gone.
    Returns TERMINATED, KILLED or SURVIVED (even SIGKILL).
    """
    if first is not None:
        send(first)
    if gone_within(grace_s):
        return TERMINATED
    send(signal.SIGKILL)
    return KILLED if gone_within(kill_wait_s) else SURVIVED


@dataclass(frozen=True)
class ProcessSample:
    alive: Optional[bool] = None  # None: there is no process to look at
    cpu_s: Optional[float] = None  # CPU seconds since the previous sample
    wall_s: Optional[float] = None  # wall seconds since the previous sample
    problem: Optional[str] = None  # why there is no process to look at (ambiguous match)


class CpuSampler:
    """CPU seconds a process and its descendants used since the last sample.

    Counted per process, so a child that exits does not make the total go
    backwards, and keyed by (pid, start time) so a reused pid starts afresh.
    A process seen for the first time counts in full only if it started
    since the previous sample.

    Listing descendants scans the whole process table, so it happens only
    when asked (`rescan=True`, which the monitor does when a probe failed and
    the CPU time matters) or when the root process changed.
    """

    def __init__(
        self,
        find: Callable[[], object],
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ):
        self._find = find  # returns a psutil.Process or raises ProcessNotFound
        self._clock = clock
        self._wall_clock = wall_clock
        # (monotonic time, wall time, CPU seconds by (pid, start time))
        self._last: Optional[Tuple[float, float, Dict[Tuple[int, float], float]]] = None
        self._tree: List = []

    def _procs(self, root, rescan: bool) -> List:
        if rescan or not self._tree or self._tree[0] != root:
            try:
                self._tree = [root] + root.children(recursive=True)
            except psutil.Error:
                self._tree = [root]
        return self._tree

    def sample(self, rescan: bool = True) -> ProcessSample:
        try:
            root = self._find()
            totals = _cpu_totals(root, self._procs(root, rescan))
        except AmbiguousProcess as exc:  # unknown, not dead: no evidence either way
            self._last = None
            return ProcessSample(alive=None, problem=str(exc))
        except (ProcessNotFound, psutil.NoSuchProcess):
            self._last = None
            return ProcessSample(alive=False)
        except psutil.Error:  # e.g. AccessDenied: alive, CPU unknown
            self._last = None
            return ProcessSample(alive=True)
        now, last = self._clock(), self._last
        self._last = (now, self._wall_clock(), totals)
        if last is None or now <= last[0]:
            return ProcessSample(alive=True)
        then, then_wall, before = last
        used = 0.0
        for key, total in totals.items():
            if key in before:
                used += total - before[key]
            elif key[1] >= then_wall - 1.0:  # born since: all its CPU is new
                used += total
        return ProcessSample(alive=True, cpu_s=max(0.0, used), wall_s=now - then)

    def reset(self) -> None:
        self._last = None
        self._tree = []


def _cpu_totals(root, procs: Iterable) -> Dict[Tuple[int, float], float]:
    totals = {}
    for proc in procs:
        try:
            times = proc.cpu_times()
            key = (proc.pid, proc.create_time())
        except psutil.Error:
            if proc is root:
                raise
            continue
        totals[key] = times.user + times.system
    return totals
