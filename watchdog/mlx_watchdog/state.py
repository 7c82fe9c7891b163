"""The state file: what the daemon last saw of each instance, for `status`.

One JSON file, replaced atomically after every tick. Several daemons (say one
`supervise` per model) can share it: each rewrites only its own instances,
under a lock, and leaves the others alone. An installed instance has a file
of its own (NAME.state.json) in the same kind of folder; `status` reads every
state file it finds there (status_cli.py).

Each record names its writer (daemon_pid, daemon_started: the process's start
time, so a reused pid is not taken for it) and how often it writes
(interval_s). A record whose writer is gone, or that was not updated for
STALE_INTERVALS intervals, is shown as STALE; a daemon that stops cleanly
writes STOPPED. `status --prune` forgets both.
"""

from __future__ import annotations

import fcntl
import functools
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from .redact import scrub, scrub_all
from .safefile import NotARegularFile, open_regular, write_atomically
import click

VERSION = 1
STOPPED = "stopped"  # written by a daemon that stopped cleanly
STALE = "stale (watchdog not running)"  # shown for a record whose writer is gone or silent
STALE_INTERVALS = 3
# Shown (and `status --json`'s "status") while a restart cannot fix what kills
# the server (the record's needs_attention; attention.py): a person must act.
NEEDS_ATTENTION = "needs-attention"
# `status` exits 0 only when every instance is in one of these (and not stale).
SERVING_STATES = ("healthy", "busy")


def default_state_path() -> Path:
    """$XDG_STATE_HOME/mlx-watchdog/state.json, or ~/.local/state/mlx-watchdog/state.json."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return Path(base) / "mlx-watchdog" / "state.json"


def known_state_files() -> "list[Path]":
    """The shared state file, then every state file in the installed
    instances' state folders (NAME.state.json, and a state.json there): where
    `status` and `restart NAME` look without --state-file."""
    from .install.backend import state_folders

    paths = [default_state_path()]
    for folder in [default_state_path().parent] + state_folders(home=Path.home(),
                                                                 environ=os.environ):
        try:
            paths += sorted(folder.glob("*.state.json")) + [folder / "state.json"]
        except OSError:
            continue
    return list(dict.fromkeys(paths))


def read_states(paths: "list[Path]") -> "list[Tuple[Path, Dict[str, Any]]]":
    """(path, its data) for each of paths that exists; one that cannot be
    read is named on stderr and skipped (status and restart read them so)."""
    found = []
    for path in paths:
        try:
            found.append((path, read_state(path)))
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            click.echo(f"cannot read {path}: {exc}", err=True)
    return found


class StateStore:
    """Per-instance records, written to path (None: kept in memory only).

    A change of state is written at once; other updates (a new probe time)
    at most every `min_interval_s`, so ten instances do not mean ten writes.
    """

    def __init__(
        self, path: "Optional[str | os.PathLike[str]]" = None, *, min_interval_s: float = 1.0
    ):
        self.path = Path(path) if path is not None else None
        self.min_interval_s = min_interval_s
        self.records: Dict[str, Dict[str, Any]] = {}
        self.error: Optional[str] = None  # the last write failure, if any
        self._lock = threading.Lock()
        self._others: Dict[str, Any] = {}  # other daemons' instances
        self._written: Optional[Tuple[int, int, int]] = None  # the file as we left it
        self._written_at = float("-inf")
        self._dirty = False
        self._closed = False  # stopped(): no more updates

    def update(self, name: str, record: Dict[str, Any]) -> None:
        now = time.time()
        record = dict(record, daemon_pid=os.getpid(), daemon_started=_started_at(os.getpid()),
                      updated=now)
        with self._lock:
            if self._closed:
                return  # a monitor thread still finishing its tick after the stop
            changed = self.records.get(name, {}).get("state") != record.get("state")
            self.records[name] = record
            self._dirty = True
            if changed or now - self._written_at >= self.min_interval_s:
                self._flush(now)

    def flush(self, timeout: float = 5.0) -> None:
        """Write whatever is not written yet (at exit). Gives up after timeout
        if a monitor thread holds the lock: exiting on SIGTERM comes first."""
        if not self._lock.acquire(timeout=timeout):
            return
        try:
            self._flush(time.time())
        finally:
            self._lock.release()

    def stopped(self, why: str) -> None:
        """A clean stop: every instance of this daemon reads STOPPED from now on."""
        now = time.time()
        with self._lock:
            self._closed = True
            for record in self.records.values():
                record.update(state=STOPPED, reason=why, since=now, updated=now)
            self._dirty = bool(self.records)
        self.flush()

    def _flush(self, now: float) -> None:
        if self.path is not None and self._dirty:
            self._write(self.path)
            self._written_at, self._dirty = now, False

    def _write(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # O_NOFOLLOW and no blocking on a FIFO: see safefile.py.
            with os.fdopen(open_regular(f"{path}.lock", os.O_RDWR | os.O_CREAT), "r+b") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if _signature(path) != self._written:  # someone else wrote since
                    self._others = _other_daemons_instances(path)
                instances = dict(self._others, **self.records)
                _write_state(path, {"version": VERSION, "instances": instances})
                self._written = _signature(path)
            self.error = None
        except NotARegularFile as exc:
            self.error = f"cannot write state file {path}: {exc.strerror}"
        except OSError as exc:
            self.error = f"cannot write state file {path}: {exc.strerror or exc}"


@functools.lru_cache(maxsize=4)
def _started_at(pid: int) -> Optional[float]:
    """When process pid started (psutil), or None: with the pid, it names one
    process for good, whereas a pid alone may be reused. (Cached: asked for
    our own pid at every update.)"""
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # noqa: BLE001 - psutil missing or the process gone
        return None


def writer_running(record: Dict[str, Any]) -> bool:
    """Whether the daemon that wrote record still runs (the same process, not
    a reused pid). A record that names no writer is taken as running."""
    pid = record.get("daemon_pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return not isinstance(pid, int)
    try:
        import psutil

        started = psutil.Process(pid).create_time()
    except ImportError:  # pragma: no cover - psutil is a dependency
        return True
    except Exception:  # noqa: BLE001 - NoSuchProcess, ZombieProcess: gone
        return False
    recorded = record.get("daemon_started")
    return not is_number(recorded) or abs(started - recorded) < 1.0


def shown_state(record: Dict[str, Any], now: float, running: bool) -> str:
    """What `status` calls the instance: its state, STOPPED, or STALE when the
    writer is gone or has not updated it for STALE_INTERVALS intervals, or
    NEEDS_ATTENTION while a restart cannot fix what kills it."""
    state = record.get("state", "?")
    if state == STOPPED:
        return STOPPED
    if not running:
        return STALE
    updated, interval = record.get("updated"), record.get("interval_s")
    if is_number(updated) and is_number(interval) and interval > 0:
        if now - updated > STALE_INTERVALS * interval:
            return STALE
    if isinstance(record.get("needs_attention"), dict):
        return NEEDS_ATTENTION
    return str(state)


def prune_state(path: "str | os.PathLike[str]",
                gone: Callable[[Dict[str, Any]], bool]) -> "list[str]":
    """Forget the instances of path for which gone(record) is true (under the
    writers' lock); the names forgotten."""
    path = Path(path)
    with os.fdopen(open_regular(f"{path}.lock", os.O_RDWR | os.O_CREAT), "r+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = read_state(path)
        instances = data["instances"]
        forgotten = [name for name, record in instances.items()
                     if not isinstance(record, dict) or gone(record)]
        if forgotten:
            for name in forgotten:
                del instances[name]
            _write_state(path, data)
    return forgotten


def _signature(path: Path) -> Optional[Tuple[int, int, int]]:
    try:
        st = path.lstat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _other_daemons_instances(path: Path) -> Dict[str, Any]:
    try:
        instances = read_state(path).get("instances", {})
    except (OSError, ValueError):
        return {}
    me = os.getpid()
    return {
        name: record
        for name, record in instances.items()
        if isinstance(record, dict) and record.get("daemon_pid") != me
    }


def _write_state(path: Path, data: Dict[str, Any]) -> None:
    # Compact: the C encoder is several times cheaper than indent=.
    # scrub: a key may hide in any reason or detail, JSON-escaped here.
    text = json.dumps(scrub_all(data), separators=(",", ":"), sort_keys=True)
    write_atomically(path, scrub(text) + "\n")


def read_state(path: "str | os.PathLike[str]") -> Dict[str, Any]:
    """The state file's content; FileNotFoundError or ValueError if unusable."""
    with os.fdopen(open_regular(path), "rb") as handle:
        data = json.loads(handle.read())
    if not isinstance(data, dict) or not isinstance(data.get("instances"), dict):
        raise ValueError(f"{path} is not an mlx-watchdog state file")
    return data


def writer_alive(record: Dict[str, Any],
                 pid_alive: Optional[Callable[[int], bool]] = None) -> bool:
    """writer_running, or pid_alive(pid) (tests' stand-in) when given."""
    if pid_alive is None:
        return writer_running(record)
    pid = record.get("daemon_pid")
    return pid_alive(pid) if isinstance(pid, int) and not isinstance(pid, bool) else True


def status_of(record: Any, now: float,
              pid_alive: Optional[Callable[[int], bool]] = None) -> str:
    """shown_state of a record as read from a file (a malformed one is "?")."""
    if not isinstance(record, dict):
        return "?"
    try:
        return shown_state(record, now, writer_alive(record, pid_alive))
    except Exception:  # noqa: BLE001 - a malformed record
        return "?"


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool): a number a record may hold."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
