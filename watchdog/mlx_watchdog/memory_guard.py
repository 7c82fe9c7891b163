"""The memory guard of one instance: evidence -> MemoryJudge -> what to do.

Each monitor tick (monitor.py) calls ``MemoryGuard.tick(record)`` with the
heartbeat record it read. The guard measures (memory.measure: the
watchdog's own phys_footprint read on macOS, else the heartbeat's, else the
RSS of the server's process tree; never less than mlx_active), asks the
judge (memory_judge.py), and acts on what is not a restart itself:

- the soft line: the request file ``<heartbeat>.memory`` (memory.write_request)
  asks the shim for a trim and keeps its /health at 503 ``{"status":
  "memory"}`` for ``soft_hold_s``, rewritten each tick while above the line
  (so a watchdog that dies lets go on its own); one log line when it starts,
  one when it clears;
- a restart wanted and due: a crash report of kind ``memory`` with the last
  hour's samples, written where the shim's reports go; the monitor then
  takes the planned (drained) restart with cause ``memory``;
- after any restart, on macOS: WiredWatch says whether the wired memory came
  back, else "reboot required" (log, status, metric), and restarts are held.

Every reader is injected (``Readers``), so tests drive it with numbers.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional

from . import __version__
from . import memory as mem
from .log import Events
from .memory_judge import (
    CAUSE, MEMORY_SOFT, MEMORY_HARD, OK, REBOOT_REQUIRED, MemoryDecision, MemoryGuardConfig,
    MemoryJudge, WiredWatch,
)

REPORT_KIND = "memory"
# How long one write of the request keeps /health at 503 memory: a few ticks,
# so a tick that runs late does not flap it, and a watchdog gone lets go.
SOFT_HOLD_MIN_S = 30.0
# The trend's fit needs samples spanning this share of the horizon (at most
# the judge's own 15 min): 15 min of data say little about 6 h, and a short
# horizon (a test, a small machine) needs less.
TREND_SPAN_SHARE = 0.25


def _footprint(pid: int) -> Optional[Dict[str, int]]:
    from .macos import footprint

    return footprint(pid)


def _wired() -> Optional[int]:
    from .macos import wired_bytes

    return wired_bytes()


@dataclass
class Readers:
    footprint: Callable[[int], Optional[Dict[str, int]]] = _footprint  # macOS rusage
    tree_rss: Callable[[int], Optional[int]] = mem.tree_rss
    wired: Callable[[], Optional[int]] = _wired  # the machine's wired memory (macOS)


def guard_config(limit_bytes: int, *, horizon_s: float, idle_wait_s: float) -> MemoryGuardConfig:
    from .memory_judge import TREND_MIN_SPAN_S

    return MemoryGuardConfig(
        limit_bytes=limit_bytes, horizon_s=horizon_s, idle_wait_s=idle_wait_s,
        trend_min_span_s=min(TREND_MIN_SPAN_S, horizon_s * TREND_SPAN_SHARE))


@dataclass
class MemoryStatus:
    """For the state file and `status`: memory against the limit."""

    bytes: Optional[int] = None
    limit_bytes: Optional[int] = None
    share: Optional[float] = None
    state: str = "unknown"
    source: str = ""
    reason: str = ""
    restarts: int = 0
    reboot_required: Optional[str] = None
    parts: Dict[str, int] = field(default_factory=dict)

    def as_record(self) -> Dict[str, Any]:
        return {"bytes": self.bytes, "limit_bytes": self.limit_bytes,
                "share": None if self.share is None else round(self.share, 4),
                "state": self.state, "source": self.source, "reason": self.reason,
                "restarts": self.restarts, "reboot_required": self.reboot_required,
                "parts": dict(self.parts)}


class MemoryGuard:
    def __init__(
        self,
        name: str,
        config: MemoryGuardConfig,
        *,
        heartbeat_file: Optional[str],
        report_dir: Path,
        events: Events,
        metrics=None,
        limit_reason: str = "",
        pid: Optional[Callable[[], Optional[int]]] = None,  # the server's pid, when known
        interval_s: float = 5.0,
        readers: Optional[Readers] = None,
        instance: Optional[Dict[str, Any]] = None,  # a report's instance field
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
    ):
        self.name = name
        self.config = config
        self.judge = MemoryJudge(config)
        self.heartbeat_file = heartbeat_file
        self.report_dir = report_dir
        self.events = events
        self.metrics = metrics
        self.pid = pid
        self.readers = readers or Readers()
        self.instance = instance
        self.clock, self.wall_clock = clock, wall_clock
        self.soft_hold_s = max(SOFT_HOLD_MIN_S, 3 * interval_s)
        self.status = MemoryStatus(limit_bytes=config.limit_bytes, reason=limit_reason)
        self.wired = WiredWatch()
        self._trim = 0  # the request number the shim serves when it changes
        self._soft = False
        self._server_pid: Optional[int] = None
        self._last_wired: Optional[int] = None
        self._held: Optional[int] = None  # what the server held wired (for WiredWatch)
        self._last_beat: Optional[mem.HeartbeatMemory] = None
        self._said_pending: Optional[str] = None
        self._request_error: Optional[str] = None
        if metrics is not None:
            metrics.memory_limit(name, config.limit_bytes)

    # -- each tick ---------------------------------------------------------------

    def tick(self, record: Optional[Mapping[str, Any]]) -> MemoryDecision:
        """Measure, judge, act on the soft line; the decision (restart: the
        caller restarts, after report() wrote the evidence)."""
        now = self.clock()
        pid = self._pid(record)
        beat = mem.parse_heartbeat_memory((record or {}).get("memory")) if self._ours(
            record, pid) else None
        own = self.readers.footprint(pid) if pid else None
        footprint = (own or {}).get("phys_footprint")
        rss = self.readers.tree_rss(pid) if pid and footprint is None else None
        measured = mem.measure(footprint=footprint, heartbeat=beat, tree_rss=rss)
        in_flight = (record or {}).get("in_flight") if beat is not None else None
        if not isinstance(in_flight, int) or isinstance(in_flight, bool):
            in_flight = None
        decision = self.judge.observe(now, measured.bytes if measured else None, in_flight)
        self._last_beat = beat
        if own and own.get("wired_size"):
            self._held = own["wired_size"]
        elif beat is not None and beat.mlx_active is not None:
            self._held = beat.mlx_active
        self.watch_wired()
        self._update_status(decision, measured, beat, rss, footprint)
        self._act_soft(decision, pid)
        self._say_pending(decision)
        return decision

    def _pid(self, record: Optional[Mapping[str, Any]]) -> Optional[int]:
        pid = self.pid() if self.pid is not None else None
        if pid is None and record and isinstance(record.get("pid"), int):
            pid = record["pid"]
        if pid != self._server_pid:
            self._server_pid = pid
        return pid

    @staticmethod
    def _ours(record: Optional[Mapping[str, Any]], pid: Optional[int]) -> bool:
        """The heartbeat is the current server's (not one left by the last)."""
        return bool(record) and (pid is None or record.get("pid") == pid)

    def _update_status(self, decision: MemoryDecision, measured, beat, rss, footprint) -> None:
        status = self.status
        status.bytes = decision.measure
        status.share = decision.share
        status.state = decision.state
        status.source = measured.source if measured else ""
        if decision.measure is not None:
            status.reason = decision.reason
        parts: Dict[str, int] = {}
        if decision.measure is not None:
            parts["measure"] = decision.measure
        if footprint is not None:
            parts["phys_footprint"] = footprint
        if rss is not None:
            parts["tree_rss"] = rss
        if beat is not None:
            for name in ("rss", "mlx_active", "mlx_cache", "mlx_peak", "prompt_cache_bytes"):
                value = getattr(beat, name)
                if value is not None:
                    parts[name] = value
        status.parts = parts
        if self.metrics is not None:
            self.metrics.memory(self.name, parts, soft=decision.soft)

    def _act_soft(self, decision: MemoryDecision, pid: Optional[int]) -> None:
        if decision.trim:
            self._trim += 1
        if decision.soft and pid:
            self._request(pid, soft_until=self.wall_clock() + self.soft_hold_s)
        if decision.soft and not self._soft:
            self.events.warning(MEMORY_SOFT, f"memory over the soft line: {decision.reason}; "
                                             "asked the server to trim, /health says 503 memory",
                                state=MEMORY_SOFT, trim=self._trim)
        elif self._soft and not decision.soft and decision.state != "unknown":
            self.events.info("memory", f"memory back under the soft line: {decision.reason}")
            if pid:
                self._request(pid)  # /health serves again now, not when the hold runs out
        if decision.state != "unknown":
            self._soft = decision.soft

    def _request(self, pid: int, soft_until: Optional[float] = None) -> None:
        """Write the shim's request file; a failure is said once, never raised."""
        if not self.heartbeat_file:
            return
        try:
            mem.write_request(self.heartbeat_file, pid=pid, trim=self._trim or None,
                              soft_until=soft_until)
            self._request_error = None
        except OSError as exc:
            problem = f"cannot write {mem.request_path(self.heartbeat_file)}: " \
                      f"{exc.strerror or exc}"
            if problem != self._request_error:
                self.events.warning("memory", problem + " (the server cannot be asked to trim)")
            self._request_error = problem

    def _say_pending(self, decision: MemoryDecision) -> None:
        if decision.restart_pending and decision.trigger != self._said_pending:
            self.events.warning(MEMORY_HARD if decision.state == MEMORY_HARD else "memory",
                                decision.reason, trigger=decision.trigger)
        self._said_pending = decision.trigger if decision.restart_pending else None

    # -- a restart ---------------------------------------------------------------

    def report(self, decision: MemoryDecision, reason: str) -> Optional[Path]:
        """The `memory` crash report: the decision, the memory, the last hour's
        samples. Never raises."""
        from .heartbeat import read_record
        from .reports import SCHEMA, write_report

        try:
            now_mono, now_wall = self.clock(), self.wall_clock()
            samples = [{"time": round(now_wall - (now_mono - t), 3), "bytes": int(b)}
                       for t, b in self.judge.samples()]
            beat = read_record(self.heartbeat_file) if self.heartbeat_file else None
            memory = {k: v for k, v in self.status.parts.items()}
            memory["limit_bytes"] = self.config.limit_bytes
            report: Dict[str, Any] = {
                "schema": SCHEMA,
                "kind": REPORT_KIND,
                "cause": CAUSE,
                "time": now_wall,
                "pid": self._server_pid,
                "source": "watchdog",
                "reason": reason,
                "trigger": decision.trigger,
                "memory": memory,
                "memory_source": self.status.source,
                "limit_bytes": self.config.limit_bytes,
                "soft_line_bytes": int(self.config.soft_line),
                "hard_line_bytes": int(self.config.hard_line),
                "horizon_s": self.config.horizon_s,
                "eta_s": decision.eta_s,
                "samples": samples,
                "in_flight": (beat or {}).get("in_flight"),
                "exit_code": None,
                "versions": {"mlx_watchdog": __version__,
                             "python": platform.python_version(), "os": platform.platform()},
            }
            if beat is not None:
                report["heartbeat"] = beat
            if self.instance is not None:
                report["instance"] = self.instance
            path = write_report(self.report_dir, report)
        except Exception:  # noqa: BLE001 - evidence must never block the restart
            return None
        if path is not None:
            self.events.info("report", f"wrote {path}", kind=REPORT_KIND)
        return path

    def restarted(self, ok: bool) -> None:
        """A planned memory restart was taken (ok: a new server started)."""
        self.status.restarts += 1

    def server_ended(self) -> None:
        """The server process is gone (any restart): start afresh, and watch
        whether the machine's wired memory comes back (macOS)."""
        now = self.clock()
        self.wired.server_ended(now, wired_before=self._last_wired, held=self._held)
        # Look at once: the old process is gone and the new one (just spawned,
        # still importing) has wired nothing yet; a tick later it may have.
        self.watch_wired()
        self.judge.reset()
        self._held = None
        self._soft = False
        self._said_pending = None
        if self.heartbeat_file:
            mem.clear_request(self.heartbeat_file)

    # -- wired memory (macOS) -------------------------------------------------------

    def watch_wired(self) -> None:
        """Read the machine's wired memory (macOS) and update the reboot
        verdict; every tick, the server's exit ticks included."""
        now = self.clock()
        wired = self.readers.wired()
        if wired is not None:
            self._last_wired = wired
        verdict = self.wired.observe(now, wired)
        required = verdict.reason if verdict.state == REBOOT_REQUIRED else None
        if required != self.status.reboot_required:
            if required:
                self.events.error("reboot-required", required)
            else:
                self.events.info("reboot-required", f"cleared: {verdict.reason}")
            self.status.reboot_required = required
        if self.metrics is not None:
            self.metrics.reboot_required(self.name, required is not None)

    @property
    def hold_restarts(self) -> Optional[str]:
        """Why restarts are held (reboot required), or None."""
        return self.status.reboot_required

    def samples(self) -> List[tuple]:
        return self.judge.samples()


STATES = (OK, MEMORY_SOFT, MEMORY_HARD)
