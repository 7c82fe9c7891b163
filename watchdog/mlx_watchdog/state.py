"""The state file: what the daemon last saw of each instance, for `status`.

One JSON file, replaced atomically after every tick. Several daemons (say one
`supervise` per model) can share it: each rewrites only its own instances,
under a lock, and leaves the others alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from .redact import printable, scrub, scrub_all
from .safefile import NotARegularFile, open_regular

VERSION = 1


def default_state_path() -> Path:
    """$XDG_STATE_HOME/mlx-watchdog/state.json, or ~/.local/state/mlx-watchdog/state.json."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return Path(base) / "mlx-watchdog" / "state.json"


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

    def update(self, name: str, record: Dict[str, Any]) -> None:
        now = time.time()
        record = dict(record, daemon_pid=os.getpid(), updated=now)
        with self._lock:
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
                _write_atomically(path, {"version": VERSION, "instances": instances})
                self._written = _signature(path)
            self.error = None
        except NotARegularFile as exc:
            self.error = f"cannot write state file {path}: {exc.strerror}"
        except OSError as exc:
            self.error = f"cannot write state file {path}: {exc.strerror or exc}"


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


def _write_atomically(path: Path, data: Dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            # Compact: the C encoder is several times cheaper than indent=.
            # scrub: a key may hide in any reason or detail, JSON-escaped here.
            text = json.dumps(scrub_all(data), separators=(",", ":"), sort_keys=True)
            handle.write(scrub(text) + "\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_state(path: "str | os.PathLike[str]") -> Dict[str, Any]:
    """The state file's content; FileNotFoundError or ValueError if unusable."""
    with os.fdopen(open_regular(path), "rb") as handle:
        data = json.loads(handle.read())
    if not isinstance(data, dict) or not isinstance(data.get("instances"), dict):
        raise ValueError(f"{path} is not an mlx-watchdog state file")
    return data


def format_status(
    data: Dict[str, Any],
    *,
    now: Optional[float] = None,
    pid_alive: Optional[Callable[[int], bool]] = None,
) -> str:
    """The state file as text for people.

    The file may be damaged, old or hand-edited: a record of the wrong shape
    is shown as such, never a traceback; control characters are escaped.
    """
    now = time.time() if now is None else now
    if pid_alive is None:
        import psutil

        pid_alive = psutil.pid_exists
    instances = data.get("instances", {})
    if not instances:
        return "no instances in the state file"
    lines = []
    for name in sorted(instances, key=str):
        try:
            lines += _format_record(name, instances[name], now, pid_alive)
        except Exception as exc:  # a malformed record: say so, go on
            lines.append(f"{printable(name)}: malformed record ({type(exc).__name__})")
    return scrub("\n".join(lines))


def _format_record(name: str, record: Any, now: float, pid_alive: Callable[[int], bool]):
    if not isinstance(record, dict):
        return [f"{printable(name)}: malformed record (not a table)"]
    p = printable
    lines = []
    since = _ago(now, record.get("since"), suffix="")
    lines.append(f"{p(name)}: {p(record.get('state', '?'))} for {since}  {p(record.get('url', ''))}")
    if record.get("reason"):
        lines.append(f"  why: {p(record['reason'])}")
    probe = record.get("last_probe")
    if isinstance(probe, dict):
        latency = probe.get("latency_s")
        latency = f"{latency:.2f}s" if _is_number(latency) else "?"
        lines.append(
            f"  last probe: {p(probe.get('status'))} in {latency}, "
            f"{_ago(now, probe.get('time'))}"
            + (f" ({p(probe.get('reason'))})" if probe.get("status") != "ok" else "")
        )
    restart = record.get("last_restart")
    count = record.get("restarts", 0)
    count = count if _is_number(count) else "?"
    if isinstance(restart, dict):
        outcome = "ok" if restart.get("ok") else "FAILED"
        lines.append(
            f"  restarts: {count}, last {_ago(now, restart.get('time'))} "
            f"({p(restart.get('cause'))}, {outcome}: {p(restart.get('detail'))})"
        )
    else:
        lines.append(f"  restarts: {count}")
    pid = record.get("daemon_pid")
    if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 and not pid_alive(pid):
        lines.append(
            f"  note: the watchdog that wrote this (pid {pid}) is not running; "
            f"last update {_ago(now, record.get('updated'))}"
        )
    return lines


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _ago(now: float, then: Any, suffix: str = " ago") -> str:
    if not _is_number(then):
        return "?"
    seconds = max(0, int(now - then))
    if seconds < 60:
        text = f"{seconds}s"
    elif seconds < 3600:
        text = f"{seconds // 60}m{seconds % 60:02d}s"
    elif seconds < 86400:
        text = f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    else:
        text = f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"
    return text + suffix
