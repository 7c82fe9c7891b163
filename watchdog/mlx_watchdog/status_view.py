"""`status` for people: the state file as a fleet table, one row per
instance, then the details of each instance that is not well.

Presentation only; what a record's state is comes from state.py.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, Optional

import click

from .redact import printable, printable_lines, scrub
from .state import (NEEDS_ATTENTION, STALE, STALE_INTERVALS, STOPPED, is_number, shown_state,
                    writer_alive)

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
            running = writer_alive(record, pid_alive)
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
    if is_number(used) and is_number(limit) and limit > 0:
        text = f"{_size(used)}/{_size(limit)} {used / limit:.0%}"
    elif is_number(limit):
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
        latency = f"{latency:.2f}s" if is_number(latency) else "?"
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


def _ago(now: float, then: Any, suffix: str = " ago") -> str:
    if not is_number(then):
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
