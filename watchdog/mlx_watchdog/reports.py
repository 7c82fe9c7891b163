"""Crash reports on the watchdog's side: stacks before a kill, and reading.

The hotfix shim writes reports into its report dir (see
sitecustomize/mlx_hotfix/reports.py; the folder, the file names, KEEP,
SCHEMA and pruning are the shim's contract module's, contract.py) and arms
faulthandler so that SIGUSR1 dumps every thread's stack into
``stacks-<pid>.txt`` there. Before the watchdog stops a wedged server it calls
``capture_stacks``: SIGUSR1 (only to a pid whose stacks file exists: without
the shim's handler SIGUSR1 would kill the process), a short wait, then a
``wedged`` report with those stacks. The stop ladder is then SIGTERM, a grace
(30 s by default), SIGKILL: a SIGKILLed process holding a large wired model on
macOS has been reported to leak the wired memory until reboot, while SIGTERM
released it (jundot/omlx #2184).
"""

from __future__ import annotations

import json
import os
import platform
import signal
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

from . import __version__, contract, defaults
from .heartbeat import read_record
from .redact import printable, printable_lines
from .safefile import open_regular, read_regular, write_atomically

KEEP = contract.KEEP
SCHEMA = contract.SCHEMA
report_name = contract.report_name


def report_dir(configured: "Optional[str | os.PathLike[str]]" = None) -> Path:
    """Where reports live: configured, $MLX_HOTFIX_REPORT_DIR, or the default."""
    if configured:
        return Path(os.path.expanduser(os.fspath(configured)))
    return Path(contract.report_dir())


def stacks_file(directory: Path, pid: int) -> Path:
    return directory / contract.stacks_name(pid)


def write_report(directory: Path, report: Dict[str, Any], keep: int = KEEP) -> Optional[Path]:
    """Write report whole (mkstemp + os.replace), mode 0600; prune. None on failure."""
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        name = report_name(report["kind"], int(report.get("pid") or 0), report["time"])
        text = json.dumps(report, indent=1, sort_keys=True, default=repr)
        write_atomically(directory / name, text + "\n", mode=0o600)
        prune(directory, keep)
        return directory / name
    except OSError:
        return None


def prune(directory: Path, keep: int = KEEP) -> None:
    """Keep the newest `keep` reports; other files in the folder are not ours."""
    contract.prune(directory, keep)


def report_files(directory: Path) -> List[Path]:
    """The reports in directory, oldest first: only report names (REPORT_NAME)."""
    return [directory / name for name in contract.report_names(directory)]


def _read_new(path: Path, offset: int) -> str:
    try:
        with os.fdopen(open_regular(path), "rb") as handle:  # no link, no FIFO
            handle.seek(offset)
            return handle.read(1 << 20).decode(errors="replace")
    except OSError:
        return ""


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def request_stacks(
    pids: Iterable[int], directory: Path, wait_s: float = defaults.STACKS_WAIT_S
) -> Dict[int, str]:
    """SIGUSR1 each pid that has a stacks file; {pid: the stacks it wrote}."""
    sent: Dict[int, int] = {}
    for pid in pids:
        path = stacks_file(directory, pid)
        size = _size(path)
        if size < 0:
            continue  # no shim handler in that process: SIGUSR1 would kill it
        try:
            os.kill(pid, signal.SIGUSR1)
            sent[pid] = size
        except OSError:
            continue
    stacks: Dict[int, str] = {}
    deadline = time.monotonic() + wait_s
    while sent and time.monotonic() < deadline:
        time.sleep(0.05)
        for pid, size in list(sent.items()):
            now_size = _size(stacks_file(directory, pid))
            # faulthandler writes in one go from the signal handler; a size
            # that stopped growing is the whole dump.
            if now_size > size:
                time.sleep(0.05)
                if _size(stacks_file(directory, pid)) == now_size:
                    stacks[pid] = _read_new(stacks_file(directory, pid), size)
                    del sent[pid]
    return stacks


def capture_stacks(
    pids: Iterable[int],
    *,
    reason: str,
    directory: Optional[Path] = None,
    kind: str = "wedged",
    heartbeat_file: "Optional[str | os.PathLike[str]]" = None,
    wait_s: float = defaults.STACKS_WAIT_S,
    extra: Optional[Dict[str, Any]] = None,
) -> Optional[Path]:
    """Before a kill: ask for the stacks, write a `kind` report. Never raises."""
    try:
        directory = directory or report_dir()
        pids = [p for p in pids if p]
        stacks = request_stacks(pids, directory, wait_s)
        report: Dict[str, Any] = {
            "schema": SCHEMA,
            "kind": kind,
            "time": time.time(),
            "pid": pids[0] if pids else None,
            "source": "watchdog",
            "reason": reason,
            "stacks_text": "\n".join(stacks.values()) or None,
            "stacks_from": sorted(stacks),
            "versions": {
                "mlx_watchdog": __version__,
                "python": platform.python_version(),
                "os": platform.platform(),
            },
            "in_flight": None,
            "exit_code": None,
        }
        if not stacks:
            report["note"] = "no stacks: the process has no shim stacks file or did not answer"
        if heartbeat_file is not None:
            beat = read_record(heartbeat_file)  # safe: no link, no FIFO
            if beat is not None:
                report["heartbeat"] = beat
                report["in_flight"] = beat.get("in_flight")
        report.update(extra or {})
        return write_report(directory, report)
    except Exception:  # noqa: BLE001 - evidence must never block the restart
        return None


def write_killed_report(death: Dict[str, Any], *, directory: Optional[Path] = None,
                        extra: Optional[Dict[str, Any]] = None) -> Optional[Path]:
    """A `killed` report for a death that left none of its own (a SIGKILL: the
    OOM killer, jetsam, a person): the class and what is known (death: a
    signatures.death_record). Never raises."""
    try:
        report: Dict[str, Any] = {
            "schema": SCHEMA, "kind": "killed", "time": death.get("time") or time.time(),
            "pid": death.get("pid"), "source": "watchdog", "exit_code": death.get("exit_code"),
            "in_flight": None, "reason": f"{death.get('title')}; no report of its own",
            "cause": death.get("cause"), "cause_title": death.get("title"),
            "remedy": death.get("remedy"), "cause_source": death.get("source"),
            "restart_helps": death.get("restart_helps"), "cause_detail": death.get("detail"),
            "versions": {"mlx_watchdog": __version__, "python": platform.python_version(),
                         "os": platform.platform()},
        }
        report.update(extra or {})
        return write_report(directory or report_dir(), report)
    except Exception:  # noqa: BLE001 - evidence must never block the restart
        return None


def instance_field(name: str, url: str, command: Sequence[str] = ()) -> dict:
    """A report's `instance` field, as the shim writes it: name, port, model."""
    from urllib.parse import urlsplit

    try:
        port = urlsplit(url).port
    except ValueError:
        port = None
    from .urls import flag_value

    return {"name": name, "port": port, "model": flag_value(command, "--model")}


# -- reading -----------------------------------------------------------------


# The fields the listing and the Markdown read, and what each must be. A
# report whose field is something else (a string time, 1e300, a string
# where an object was) is listed as unreadable, not a traceback.
_NUMBER, _TEXT, _OBJECT, _LIST = (int, float), (str,), (dict,), (list,)
_FIELDS = {
    "time": _NUMBER, "kind": _TEXT, "pid": (int,), "in_flight": _NUMBER,
    "exit_code": (int,), "uptime_s": _NUMBER, "reason": _TEXT, "status": _TEXT,
    "versions": _OBJECT, "exception": _OBJECT, "memory": _OBJECT,
    "in_flight_requests": _LIST, "argv": _LIST, "stacks": _LIST,
    "stacks_text": _TEXT, "fatal_stacks": _TEXT,
}
_EXCEPTION_FIELDS = ("type", "message", "traceback")
_REPORT_BYTES = 16 << 20
UNREADABLE = "unreadable"  # the key of a report that could not be read, and why


def load_reports(directory: Path) -> List[Dict[str, Any]]:
    """Every report, newest first; each gets "id" (its file stem). A file that
    cannot be read or is malformed is listed as {"id", "time" (its mtime),
    "unreadable": why}."""
    out = [_load(path) for path in report_files(directory)]
    out.sort(key=lambda r: (r["time"], r["id"]), reverse=True)
    return out


def _load(path: Path) -> Dict[str, Any]:
    try:
        mtime = path.lstat().st_mtime
    except OSError:
        mtime = 0.0
    try:
        # The server's user writes this folder: no link, no FIFO, bounded.
        text = read_regular(path, _REPORT_BYTES + 1)
        if len(text) > _REPORT_BYTES:
            raise ValueError(f"larger than {_REPORT_BYTES >> 20} MiB")
        data = json.loads(text)
        problem = malformed(data)
    except OSError as exc:
        problem = exc.strerror or str(exc)
    except ValueError as exc:  # also UnicodeDecodeError, RecursionError's kin
        problem = f"not JSON ({exc})"
    except RecursionError:
        problem = "not JSON (nested too deep)"
    if problem:
        return {"id": path.stem, "time": mtime, UNREADABLE: problem}
    data["id"] = path.stem
    if data.get("time") is None:
        data["time"] = mtime
    return data


def malformed(data: Any) -> Optional[str]:
    """What makes data unusable as a report (None: nothing)."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    for key, kinds in _FIELDS.items():
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
            return f"{key} is {_json_kind(value)}"
    when = data.get("time")
    if when is not None:
        try:
            time.localtime(when)
        except (OverflowError, OSError, ValueError):
            return f"time {when!r} is not a date"
    for key in _EXCEPTION_FIELDS:
        value = (data.get("exception") or {}).get(key)
        if value is not None and not isinstance(value, str):
            return f"exception.{key} is {_json_kind(value)}"
    for key in ("versions", "memory"):
        if any(not isinstance(k, str) for k in (data.get(key) or {})):
            return f"{key} has a key that is not text"
    if any(not isinstance(item, str) for item in data.get("argv") or []):
        return "argv holds something other than text"
    if any(not isinstance(item, dict) for item in data.get("in_flight_requests") or []):
        return "in_flight_requests holds something other than objects"
    if any(not isinstance(item, dict) for item in data.get("stacks") or []):
        return "stacks holds something other than objects"
    return None


def _json_kind(value: Any) -> str:
    names = {bool: "true/false", int: "a number", float: "a number", str: "a string",
             list: "a list", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def find_report(directory: Path, wanted: str) -> Optional[Dict[str, Any]]:
    """By id, unique id prefix, or 1-based index in the newest-first list."""
    reports = load_reports(directory)
    if wanted.isdigit() and 0 < int(wanted) <= len(reports) and len(wanted) < 6:
        return reports[int(wanted) - 1]
    exact = [r for r in reports if r["id"] == wanted or r["id"] + ".json" == wanted]
    if exact:
        return exact[0]
    prefixed = [r for r in reports if r["id"].startswith(wanted)]
    return prefixed[0] if len(prefixed) == 1 else None


def instance_label(report: Dict[str, Any]) -> str:
    """The instance a report names, short: its name, else :PORT, else "-"."""
    instance = report.get("instance")
    if isinstance(instance, str):
        return instance
    if not isinstance(instance, dict):
        return "-"
    if instance.get("name"):
        return str(instance["name"])
    return f":{instance['port']}" if instance.get("port") else "-"


def matches_instance(report: Dict[str, Any], wanted: str) -> bool:
    """`reports --instance WANTED`: the instance's name, or its port."""
    instance = report.get("instance")
    if isinstance(instance, str):
        return instance == wanted
    if not isinstance(instance, dict):
        return False
    return instance.get("name") == wanted or (
        wanted.lstrip(":").isdigit() and instance.get("port") == int(wanted.lstrip(":")))


def summary(report: Dict[str, Any]) -> str:
    exc = report.get("exception") or {}
    if exc:
        text = f"{(exc.get('type') or '').rsplit('.', 1)[-1]}: {exc.get('message') or ''}"
    else:
        text = report.get("reason") or ""
    line = " ".join(str(text).split())
    line = line[:100] + ("..." if len(line) > 100 else "")
    repeats = report.get("repeats")
    if isinstance(repeats, int) and repeats > 1:
        line = f"({repeats} times, at start-up) {line}"
    return line


# A report's kinds that are a death (a wedge or a recovery is not one).
_NOT_DEATHS = ("wedged", "recovered")


def report_cause(report: Dict[str, Any]) -> Optional[Any]:
    """The class of the death a report is about (a signatures.Match), or None
    when it is not about a death (a wedge). The shim's reports carry it
    (``cause``); older ones, and fatal-stack files, are classified here from
    what they hold. Never raises."""
    from . import signatures

    try:
        module = signatures.table()
        cause = report.get("cause")
        if isinstance(cause, str) and cause in module.BY_CLASS:
            detail = report.get("cause_detail")
            return module.Match(module.entry(cause), detail if isinstance(detail, dict) else {})
        if report.get("kind") in _NOT_DEATHS:
            return None
        exc = report.get("exception") or {}
        if exc:
            return signatures.classify((exc.get("type") or "").rsplit(".", 1)[-1],
                                       exc.get("message"), exc.get("traceback"))
        return signatures.classify_text(report.get("fatal_stacks") or report.get("stacks_text")
                                        or report.get("reason"))
    except Exception:  # noqa: BLE001 - a malformed report still lists
        return None


def format_table(reports: List[Dict[str, Any]]) -> str:
    """The listing; every cell with its control characters escaped (a report
    and its file name come from the server's side)."""
    if not reports:
        return "no reports"
    rows = [("#", "ID", "TIME", "INSTANCE", "KIND", "CAUSE", "PID", "MLX-LM", "IN FLIGHT",
             "WHAT")]
    for i, r in enumerate(reports, 1):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.get("time") or 0))
        if r.get(UNREADABLE):
            cells = (str(i), r["id"], when, "-", "-", "-", "-", "-", "-",
                     f"unreadable report: {r[UNREADABLE]}")
        else:
            versions = r.get("versions") or {}
            cause = report_cause(r)
            cells = (str(i), r["id"], when, instance_label(r), str(r.get("kind")),
                     cause.cls if cause is not None else "-", str(r.get("pid")),
                     str(versions.get("mlx_lm", "-")),
                     "-" if r.get("in_flight") is None else str(r["in_flight"]), summary(r))
        rows.append(tuple(printable(cell) for cell in cells))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths)) + "  " + row[-1]
        for row in rows
    )


def format_markdown(report: Dict[str, Any]) -> str:
    """A summary to paste into an upstream issue: no prompts, no keys."""
    versions = report.get("versions") or {}
    exc = report.get("exception") or {}
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(report.get("time") or 0))
    cause = report_cause(report)
    kind = report.get("kind") if cause is None else f"{report.get('kind')}: {cause.cls}"
    lines = [f"### mlx_lm.server: {kind} ({summary(report) or 'no exception'})", ""]
    if cause is not None:  # first what it was and what to do, then where to add it
        sig = cause.entry
        lines.append(f"- **class:** `{cause.cls}`: {sig.title}")
        detail = ", ".join(f"{k}={v}" for k, v in sorted(cause.detail.items()))
        if detail:
            lines.append(f"- **what is known:** {detail}")
        lines.append(f"- **remedy:** {sig.remedy}")
        if sig.source and sig.source != "-":
            lines.append(f"- **upstream (add this report there):** {sig.source}")
        if report.get("recovery_refused"):
            lines.append(f"- **not recovered in place:** {report['recovery_refused']}")
    lines += [
        f"- mlx-lm {versions.get('mlx_lm', '?')}, mlx {versions.get('mlx', '?')}, "
        f"Python {versions.get('python', '?')}, {versions.get('os', '?')}",
        f"- when: {when}; uptime {report.get('uptime_s', '?')} s; exit code "
        f"{report.get('exit_code')}",
        f"- requests in flight: {report.get('in_flight')}",
    ]
    for shape in report.get("in_flight_requests") or []:
        fields = ", ".join(f"{k}={v}" for k, v in sorted(shape.items()) if k != "path")
        lines.append(f"  - {fields}")
    memory = report.get("memory") or {}
    if memory:
        lines.append("- memory: " + ", ".join(
            f"{k} {v / 2**20:.0f} MiB" for k, v in sorted(memory.items())
            if isinstance(v, (int, float))))
    if report.get("argv"):
        lines.append("- server arguments: `" + " ".join(report["argv"]) + "`")
    if report.get("status"):
        lines.append(f"- hotfix shim: {report['status']}")
    if exc.get("traceback"):
        lines += ["", "<details><summary>Traceback</summary>", "", "```",
                  exc["traceback"].rstrip(), "```", "</details>"]
    stacks = report.get("stacks_text") or report.get("fatal_stacks")
    if not stacks and report.get("stacks"):
        stacks = "\n".join(f"Thread {s.get('thread')}:\n{s.get('stack', '')}"
                           for s in report["stacks"])
    if stacks:
        lines += ["", "<details><summary>All threads</summary>", "", "```",
                  stacks.rstrip(), "```", "</details>"]
    lines += ["", f"_Report {report.get('id')} written by mlx-watchdog._"]
    # Line by line, control characters escaped: a terminal escape in a
    # report must not reach the operator's terminal.
    return printable_lines("\n".join(lines).split("\n")) + "\n"
