"""The state file: what the daemon last saw of each instance, for `status`.

One JSON file, replaced atomically after every tick. Several daemons (say one
`supervise` per model) can share it: each rewrites only its own instances,
under a lock, and leaves the others alone.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from .redact import printable, scrub, scrub_all
from .safefile import NotARegularFile, open_regular, write_atomically
import click

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
                _write_state(path, {"version": VERSION, "instances": instances})
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


# Colours of the states in `status` on a terminal.
_STATE_COLOURS = {
    "healthy": "green",
    "starting": "cyan",
    "busy": "yellow",
    "failing": "yellow",
    "wedged": "red",
    "down": "red",
    "crash-looping": "magenta",
}
_CALM = ("healthy", "busy", "starting")


def format_status(
    data: Dict[str, Any],
    *,
    now: Optional[float] = None,
    pid_alive: Optional[Callable[[int], bool]] = None,
    colour: bool = False,
) -> str:
    """The state file as text for people: a fleet table, one row per instance,
    then the details of each instance that is not well (colour: for a terminal)."""
    now = time.time() if now is None else now
    if pid_alive is None:
        import psutil

        pid_alive = psutil.pid_exists
    instances = data.get("instances", {})
    if not instances:
        return "no instances in the state file"
    header = ("INSTANCE", "STATE", "LAST OK PROBE", "RESTARTS", "DECODE", "NEWEST REPORT")
    rows = []
    details = []
    # The file may be damaged, old or hand-edited: a record of the wrong shape
    # is shown as such, never a traceback; control characters are escaped.
    for name in sorted(instances, key=str):
        record = instances[name]
        shown = printable(name)
        if not isinstance(record, dict):
            rows.append((shown, "?", ("malformed record (not a table)", "", "", "", "")))
            continue
        state = printable(record.get("state", "?"))
        try:
            rows.append((shown, state, tuple(printable(c) for c in _row(record, state, now))))
            lines = _details(shown, record, state, now, pid_alive)
        except Exception as exc:  # noqa: BLE001 - a malformed record: say so, go on
            rows.append((shown, "?", (f"malformed record ({type(exc).__name__})", "", "", "", "")))
            continue
        if lines:
            details.append(printable_lines(lines))
    cells = [header] + [(name, *row) for name, _state, row in rows]
    widths = [max(len(str(row[i])) for row in cells) for i in range(len(header))]

    def line(row: "tuple[str, ...]", state: Optional[str] = None) -> str:
        padded = [str(cell).ljust(width) for cell, width in zip(row, widths)]
        if colour and state is None:
            return click.style("  ".join(padded).rstrip(), bold=True)
        if colour and state in _STATE_COLOURS:
            padded[1] = click.style(padded[1], fg=_STATE_COLOURS[state], bold=state not in _CALM)
        return "  ".join(padded).rstrip()

    table = [line(header)] + [line((name, *row), state) for name, state, row in rows]
    return scrub("\n".join(table + ([""] + details if details else [])))


def printable_lines(lines: "list[str]") -> str:
    """Lines joined, each with its control characters escaped."""
    return "\n".join(printable(line) for line in lines)


def _row(record: Dict[str, Any], state: str, now: float) -> "tuple[str, ...]":
    since = _ago(now, record.get("since"), suffix="")
    last_ok = record.get("last_ok_probe")
    if isinstance(last_ok, (int, float)):
        good = _ago(now, last_ok)
    else:
        good = "never" if isinstance(record.get("last_probe"), dict) else "-"
    count = record.get("restarts", 0)
    restart = record.get("last_restart")
    restarts = str(count)
    if isinstance(restart, dict):
        failed = "" if restart.get("ok") else ", FAILED"
        restarts += f" ({restart.get('cause')} {_ago(now, restart.get('time'))}{failed})"
    server = record.get("server")
    decode = "-"
    if isinstance(server, dict):
        rate = server.get("decode_tok_s")
        if isinstance(rate, (int, float)):
            decode = f"{rate:.1f} tok/s"
        in_flight = server.get("in_flight")
        running, queued = server.get("running"), server.get("queued")
        if isinstance(running, int) and isinstance(queued, int):  # the admission part's counts
            if running or queued:
                decode += f", {running} running, {queued} queued"
        elif isinstance(in_flight, int) and in_flight:
            decode += f", {in_flight} in flight"
    report = record.get("newest_report")
    newest = "-"
    if isinstance(report, dict) and report.get("file"):
        newest = f"{os.path.basename(str(report['file']))} {_ago(now, report.get('time'))}"
    return (f"{state} {since}", good, restarts, decode, newest)


def _details(
    name: str, record: Dict[str, Any], state: str, now: float, pid_alive: Callable[[int], bool]
) -> "list[str]":
    """What a row cannot say, for an instance that is not well (or not watched)."""
    lines = []
    pid = record.get("daemon_pid")
    if isinstance(pid, int) and not pid_alive(pid):
        lines.append(
            f"  note: the watchdog that wrote this (pid {pid}) is not running; "
            f"last update {_ago(now, record.get('updated'))}"
        )
    warning = record.get("warning")
    if isinstance(warning, str) and warning:
        # A known-bad install shows even while healthy: it dies on the first request.
        lines.insert(0, f"  WARNING: {' '.join(warning.split())}")
    if state in _CALM and not lines:
        return []
    since = _ago(now, record.get("since"), suffix="")
    head = [f"{name}: {state} for {since}  {record.get('url', '')}".rstrip()]
    if record.get("reason"):
        head.append(f"  why: {record['reason']}")
    probe = record.get("last_probe")
    if isinstance(probe, dict):
        latency = probe.get("latency_s")
        latency = f"{latency:.2f}s" if _is_number(latency) else "?"
        head.append(
            f"  last probe: {probe.get('status')} in {latency}, "
            f"{_ago(now, probe.get('time'))}"
            + (f" ({probe.get('reason')})" if probe.get("status") != "ok" else "")
        )
    restart = record.get("last_restart")
    count = record.get("restarts", 0)
    if isinstance(restart, dict):
        outcome = "ok" if restart.get("ok") else "FAILED"
        head.append(
            f"  restarts: {count}, last {_ago(now, restart.get('time'))} "
            f"({restart.get('cause')}, {outcome}: {restart.get('detail')})"
        )
    report = record.get("newest_report")
    if isinstance(report, dict) and report.get("file"):
        head.append(f"  newest report: {report['file']}")
    return head + lines


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
