"""The state file: what the daemon last saw of each instance, for `status`.

One JSON file, replaced atomically after every tick. Several daemons (say one
`supervise` per model) can share it: each rewrites only its own instances,
under a lock, and leaves the others alone. An installed instance has a file
of its own (NAME.state.json) in the same kind of folder; `status` reads every
state file it finds there (daemon_cli.py).

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

from .redact import printable, scrub, scrub_all
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
    return not _is_number(recorded) or abs(started - recorded) < 1.0


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
    if _is_number(updated) and _is_number(interval) and interval > 0:
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


# Colours of the states in `status` on a terminal.
_STATE_COLOURS = {
    STALE: "red",
    STOPPED: "white",
    "healthy": "green",
    "starting": "cyan",
    "busy": "yellow",
    "failing": "yellow",
    "wedged": "red",
    "down": "red",
    "crash-looping": "magenta",
    NEEDS_ATTENTION: "red",
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
    then the details of each instance that is not well (colour: for a terminal).
    pid_alive(pid): tests' stand-in for writer_running."""
    now = time.time() if now is None else now
    instances = data.get("instances", {})
    if not instances:
        return "no instances in the state file"
    header = ("INSTANCE", "STATE", "LAST OK PROBE", "RESTARTS", "DECODE", "NEWEST REPORT")
    # MEMORY (against the limit) only when some instance has a memory guard.
    guarded = any(isinstance(r, dict) and isinstance(r.get("memory"), dict)
                  for r in instances.values())
    if guarded:
        header = header[:5] + ("MEMORY",) + header[5:]
    rows = []
    details = []
    # The file may be damaged, old or hand-edited: a record of the wrong shape
    # is shown as such, never a traceback; control characters are escaped.
    for name in sorted(instances, key=str):
        record = instances[name]
        shown = printable(name)
        if not isinstance(record, dict):
            rows.append((shown, "?", ("malformed record (not a table)",) + ("",) * (
                len(header) - 2)))
            continue
        try:
            running = _running(record, pid_alive)
            state = printable(shown_state(record, now, running))
            row = _row(record, state, now)
            if guarded:
                row = row[:4] + (memory_cell(record.get("memory")),) + row[4:]
            rows.append((shown, state, tuple(printable(c) for c in row)))
            lines = _details(shown, record, state, now, running)
        except Exception as exc:  # noqa: BLE001 - a malformed record: say so, go on
            rows.append((shown, "?", (f"malformed record ({type(exc).__name__})",) + ("",) * (
                len(header) - 2)))
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


def _running(record: Dict[str, Any], pid_alive: Optional[Callable[[int], bool]]) -> bool:
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
        return shown_state(record, now, _running(record, pid_alive))
    except Exception:  # noqa: BLE001 - a malformed record
        return "?"


def printable_lines(lines: "list[str]") -> str:
    """Lines joined, each with its control characters escaped."""
    return "\n".join(printable(line) for line in lines)


def _row(record: Dict[str, Any], state: str, now: float) -> "tuple[str, ...]":
    since = _ago(now, record.get("since") if state != STALE else record.get("updated"),
                 suffix="")
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
        death = restart.get("death_cause")
        why = f"{restart.get('cause')}: {death}" if isinstance(death, str) else restart.get("cause")
        restarts += f" ({why} {_ago(now, restart.get('time'))}{failed})"
    server = record.get("server")
    decode = "-"
    # A stopped or stale row's counts are from a server no one watches now.
    if isinstance(server, dict) and state not in (STOPPED, STALE):
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


def memory_cell(memory: Any) -> str:
    """Memory against the limit: "12.3G/20.0G 61%", with the guard's state
    when it is not ok, and REBOOT REQUIRED; "-" without a guard or a measure."""
    if not isinstance(memory, dict):
        return "-"
    used, limit = memory.get("bytes"), memory.get("limit_bytes")
    text = "-"
    if _is_number(used) and _is_number(limit) and limit > 0:
        text = f"{_size(used)}/{_size(limit)} {used / limit:.0%}"
    elif _is_number(limit):
        text = f"?/{_size(limit)}"
    if memory.get("state") in ("memory_soft", "memory_hard"):
        text += f" {memory['state']}"
    if memory.get("reboot_required"):
        text += " REBOOT REQUIRED"
    return text


def _size(value: float) -> str:
    for unit, size in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if abs(value) >= size:
            return f"{value / size:.1f}{unit}"
    return f"{int(value)}B"


def _details(
    name: str, record: Dict[str, Any], state: str, now: float, running: bool
) -> "list[str]":
    """What a row cannot say, for an instance that is not well (or not watched)."""
    lines = []
    pid = record.get("daemon_pid")
    if state == STALE:
        last = _ago(now, record.get("updated"))
        if not running:
            lines.append(f"  note: the watchdog that wrote this (pid {pid}) is not running; "
                         f"last update {last}, when it said {record.get('state')}")
        else:
            lines.append(f"  note: the watchdog (pid {pid}) has not updated this for "
                         f"{STALE_INTERVALS} intervals (last update {last}, when it said "
                         f"{record.get('state')}): is it hung or stopped?")
        lines.append("  forget it with `mlx-watchdog status --prune` if it is gone for good")
    for key in ("warning", "shim_warning"):
        warning = record.get(key)
        if isinstance(warning, str) and warning:
            # Shown even while healthy: a known-bad install dies on the first
            # request; a server without the shim would never exit on a death.
            lines.insert(0, f"  WARNING: {' '.join(warning.split())}")
    attention = record.get("needs_attention")
    if isinstance(attention, dict):  # a restart cannot fix it: a person must
        said = attention.get("message") or f"needs attention: {attention.get('cause')}"
        lines.insert(0, f"  {said} (since {_ago(now, attention.get('since'))})")
    memory = record.get("memory")
    if isinstance(memory, dict) and isinstance(memory.get("reboot_required"), str):
        lines.insert(0, f"  REBOOT REQUIRED: {' '.join(memory['reboot_required'].split())}")
    if (state in _CALM or state == STOPPED) and not lines:
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
    death = record.get("last_death")
    if isinstance(death, dict) and death.get("cause"):
        head.append(f"  last death: {death.get('cause')} ({death.get('title')}), "
                    f"{_ago(now, death.get('time'))}")
        known = death.get("detail")
        if isinstance(known, dict) and known:  # a group's failed rank and host, say
            head.append("    known: " + ", ".join(f"{k}={v}" for k, v in sorted(known.items())))
        if death.get("remedy"):
            head.append(f"    remedy: {death.get('remedy')}")
        source = death.get("source")
        if isinstance(source, str) and source not in ("", "-"):
            head.append(f"    upstream: {source}")
    report = record.get("newest_report")
    if isinstance(report, dict) and report.get("file"):
        head.append(f"  newest report: {report['file']}")
    if isinstance(memory, dict) and memory.get("reason"):
        head.append(f"  memory: {memory['reason']} (memory restarts: "
                    f"{memory.get('restarts', 0)})")
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
