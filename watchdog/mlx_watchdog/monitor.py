"""Monitor: one watched server, one `tick()` at a time.

A tick gathers the evidence (probe, process CPU, heartbeat), asks the judge,
restarts through the policy when the judge says so, and reports the outcome
to the log, the state file and the metrics. `supervise` and `watch` both run
monitors; everything a tick touches is injected, so tests drive it with fakes.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Deque, Dict, Optional, Protocol, Tuple

from .act import ActionResult, restart_planned
from .attention import AttentionTracker, NeedsAttention
from .policy import RestartPolicy
from .heartbeat import SERVING, STALLED, HeartbeatReading, HeartbeatTracker, read_record
from . import contract
from .judge import CRASH_LOOPING, DOWN, HEALTHY, STARTING, Evidence, Judge, Verdict
from .log import Events
from .memory_judge import CAUSE as MEMORY_CAUSE, MemoryDecision
from .metrics import Metrics
from .probe import UNHEALTHY, UNREACHABLE, ProbeResult
from .process import ProcessSample
from .redact import redact_url
from .state import StateStore
from .report_watcher import ReportWatcher
from .throughput import ThroughputTracker

# A restart nothing was wrong for (`mlx-watchdog restart`; the memory guard's
# has its own cause, MEMORY_CAUSE): the server drains first; counted apart
# from the judge's causes.
PLANNED = contract.PLANNED

# Restart causes whose counters exist (at zero) from the start: the judge's,
# PLANNED and MEMORY_CAUSE, the contract's vocabulary.
RESTART_CAUSES = contract.RESTART_CAUSES

PlannedDone = Callable[[ActionResult], None]


class RestartAction(Protocol):
    def restart(self, reason: str) -> ActionResult: ...


class ProcessEvidence(Protocol):
    """Like process.CpuSampler: samples the server process each tick.

    It may also have `exited() -> Optional[str]`: how the process ended, when
    that is known for sure (only a supervisor sees its child's exit status),
    and `death() -> Optional[dict]`: the class of that exit
    (signatures.death_record; a new dict for each exit).
    """

    def sample(self, rescan: bool = True) -> ProcessSample: ...

    def reset(self) -> None: ...


class Monitor:
    def __init__(
        self,
        name: str,
        probe: Callable[[], ProbeResult],
        *,
        judge: Judge,
        policy: RestartPolicy,
        action: Optional[RestartAction],  # None: watch and report, never restart
        url: str = "",
        heartbeat: Optional[HeartbeatTracker] = None,
        heartbeat_file: "Optional[str | os.PathLike[str]]" = None,  # read once per tick
        process: Optional[ProcessEvidence] = None,
        listener: Optional[Callable[[ProbeResult], Optional[str]]] = None,
        events: Optional[Events] = None,
        metrics: Optional[Metrics] = None,
        state: Optional[StateStore] = None,
        throughput: Optional[ThroughputTracker] = None,
        reports: Optional[ReportWatcher] = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        update_every_s: Optional[float] = None,  # the longest normal gap between two ticks
        expect_shim: Optional[bool] = None,  # default: when there is a heartbeat to read
        attention: Optional[AttentionTracker] = None,
        memory_guard=None,  # memory_guard.MemoryGuard: the instance has a memory limit
        keep_awake=None,  # keep_awake.KeepAwake: caffeinate for the server's pid (macOS)
    ):
        self.name = name
        self.probe = probe
        self.judge = judge
        self.policy = policy
        self.action = action
        self.url = redact_url(url)
        self.heartbeat = heartbeat
        self.heartbeat_file = heartbeat_file
        self.process = process
        self.listener = listener  # listener.ListenerCheck: who holds the port
        self._heartbeat_problem: Optional[str] = None
        self.events = events or Events(name)
        self.metrics = metrics
        self.state = state
        self.throughput = throughput
        self.reports = reports
        self.clock = clock
        self.wall_clock = wall_clock
        self.verdict: Optional[Verdict] = None
        # Set (a plain assignment, safe in a signal handler) when whoever runs
        # this monitor is stopping: an exit or a failure is then expected,
        # nothing to restart and nothing to warn about.
        self.stopping = False
        self.restarts = 0
        self._since = wall_clock()
        self._progress_at = self._since
        self._last_probe: Optional[Dict[str, Any]] = None
        self._last_restart: Optional[Dict[str, Any]] = None
        self._state_error: Optional[str] = None
        self._process_problem: Optional[str] = None
        self._last_ok_probe: Optional[float] = None
        self._abandoned = 0  # probes in a row abandoned while awaiting their answer
        self._server: Optional[Dict[str, Any]] = None  # throughput, from the heartbeat
        self._newest_report: Optional[Dict[str, Any]] = None
        self._warning: Optional[str] = None  # the shim's known-bad-install line
        self.update_every_s = update_every_s
        # The shim is expected (a heartbeat file is configured): is it loaded?
        self.expect_shim = heartbeat is not None if expect_shim is None else expect_shim
        self._shim_seen = False  # a fresh heartbeat since the (re)start
        self._shim_warning: Optional[str] = None
        # Death classes (signatures.py): the last exit's, the one the next
        # restart follows, and the run of those a restart cannot fix.
        self.attention = attention or AttentionTracker()
        self._last_death: Optional[Dict[str, Any]] = None
        self._restart_death: Optional[str] = None  # the class the next restart follows
        self._needs_attention: Optional[Dict[str, Any]] = None
        self._recorded_death: Optional[Tuple[Any, Any]] = None  # (pid, time) last noted
        self.memory_guard = memory_guard
        self.keep_awake = keep_awake
        if metrics is not None:
            metrics.add_instance(name, RESTART_CAUSES)
        self._boot_wall = wall_clock()  # when the current server was (re)started
        # Planned restarts asked for from other threads (control.py), done by tick().
        self._planned: Deque[Tuple[str, str, Optional[PlannedDone]]] = collections.deque()
        self._planned_lock = threading.Lock()
        # Set by whatever runs the ticks: cut its sleep short (a planned restart waits).
        self.wake: Callable[[], None] = lambda: None

    def started(self) -> None:
        """The server (re)started outside of a restart by this monitor."""
        self.policy.started(self.clock())
        self._forget()
        self.report(Verdict(STARTING, "started"))

    def request_planned_restart(self, reason: str, *, cause: str = PLANNED,
                                done: Optional[PlannedDone] = None) -> None:
        """From any thread: the next tick restarts the server on purpose
        (planned_restart), then calls done(result)."""
        with self._planned_lock:
            self._planned.append((reason, cause, done))
        self.wake()

    def planned_restart(self, reason: str, *, cause: str = PLANNED) -> ActionResult:
        """Restart a server nothing is known to be wrong with (an operator's
        `mlx-watchdog restart`, a memory limit): it drains first (the action's
        restart_planned: SIGTERM, the drain, then the normal stop), no stacks
        are taken, and it is logged and counted apart (`cause`), outside the
        backoff and the crash-loop count. The new server gets a boot grace."""
        if self.action is None:
            return ActionResult(False, "this instance is only watched: its config has no "
                                       "restart action ([restart] type \"none\")")
        self.events.info("restart", f"planned restart: {reason}", state=STARTING, cause=cause)
        result = restart_planned(self.action, reason)
        if result.ok:
            self.policy.started(self.clock())
            self._forget()
        else:
            # As for any failed restart: nothing was started, so no boot grace.
            self.policy.end_grace(self.clock())
        self.restarts += 1
        self._last_restart = {"time": self.wall_clock(), "cause": cause, "reason": reason,
                              "ok": result.ok, "detail": result.detail}
        if self.metrics is not None:
            self.metrics.restarted(self.name, cause)
        if result.ok:
            self.events.info("restarted", result.detail)
            self.report(Verdict(STARTING, f"planned restart: {reason}"))
        else:
            self.events.error("restart-failed", result.detail)
            self.report(Verdict(DOWN, f"restart failed: {result.detail}; planned restart: "
                                      f"{reason}"))
        return result

    def _next_planned(self) -> Optional[Tuple[str, str, Optional[PlannedDone]]]:
        with self._planned_lock:
            return self._planned.popleft() if self._planned else None

    def tick(self) -> Verdict:
        planned = self._next_planned()
        if planned is not None:
            reason, cause, done = planned
            result = self.planned_restart(reason, cause=cause)
            if done is not None:
                done(result)
            return self.verdict or Verdict(STARTING, reason)
        exited = self._exited()
        if exited is not None:
            return self._tick_exited(exited)
        probe = self.probe()
        self._note_abandoned(probe)
        port_held_by = self.listener(probe) if self.listener else None
        if port_held_by and probe.ok:
            # Another process answered: no evidence our server serves. Not a
            # "last ok probe", not up, no reset of the backoff.
            probe = replace(probe, status=UNHEALTHY, tokens=0, warning=None,
                            reason=f"not our server's answer: {port_held_by}")
        # A failed probe is when CPU time matters: then look for new child
        # processes too (a scan of the whole process table).
        sample = self.process.sample(rescan=not probe.ok) if self.process else ProcessSample()
        # One read of the heartbeat file for all its readers (safe: no link,
        # no FIFO), so they agree, and a planted FIFO cannot block the tick.
        record = read_record(self.heartbeat_file) if self.heartbeat_file else None
        beat = self.heartbeat.observe(record) if self.heartbeat else None
        self._note_heartbeat_problem()
        self._note_warning(beat, probe)
        self._note_shim(beat, probe)
        self._observe_server(record)
        if not hasattr(self.process, "death"):  # a supervisor sees its child's exits itself
            self._note_recorded_death(record)
        memory = self.memory_guard.tick(record) if self.memory_guard is not None else None
        if self.keep_awake is not None:
            pid = (record or {}).get("pid")
            self.keep_awake.observe(pid if isinstance(pid, int) and pid > 0 else None)
        now = self.clock()
        if self._loaded(beat) and self.policy.in_grace(now):
            self.policy.end_grace(now)
            self.events.info("loaded", "the heartbeat says serving: boot grace over")
        verdict = self.judge.observe(
            Evidence(
                probe=probe,
                now=now,
                booting=self.policy.in_grace(now),
                process_alive=sample.alive,
                cpu_s=sample.cpu_s,
                wall_s=sample.wall_s,
                heartbeat=beat,
                process_problem=sample.problem,
                port_held_by=port_held_by,
            )
        )
        if sample.problem != self._process_problem:  # say it once, not every tick
            if sample.problem:
                self.events.warning("process", sample.problem)
            self._process_problem = sample.problem
        if probe.ok:
            self.policy.healthy(now)
            self._served()
        elif self._delivered(beat):
            self.policy.served(now)  # it served between probes: no crash loop
        if verdict.restart:
            verdict = self.restart(verdict)
        elif memory is not None and memory.restart:
            return self._memory_restart(memory, verdict, probe)
        self.report(verdict, probe)
        return verdict

    def _memory_restart(self, decision: MemoryDecision, verdict: Verdict,
                        probe: ProbeResult) -> Verdict:
        """The memory guard wants its planned restart now: the `memory`
        report first (the samples), then the drain and a new server."""
        self.report(verdict, probe)
        if self.action is None or self.stopping:
            return self.verdict or verdict
        if self.memory_guard.hold_restarts:
            return self.verdict or verdict  # reboot required: a new server has no room
        reason = f"memory: {decision.reason}"
        self.memory_guard.report(decision, reason)
        result = self.planned_restart(reason, cause=MEMORY_CAUSE)
        self.memory_guard.restarted(result.ok)
        if self.state is not None:
            self.state.update(self.name, self.record())
        return self.verdict or verdict

    def _exited(self) -> Optional[str]:
        exited = getattr(self.process, "exited", None)
        return exited() if exited is not None else None

    def _tick_exited(self, exited: str) -> Verdict:
        """The process is gone for sure: nothing to probe or sample."""
        self._note_death()
        now = self.clock()
        gone = ProbeResult(UNREACHABLE, 0.0, reason=f"server {exited}")
        if self.memory_guard is not None:
            self.memory_guard.watch_wired()  # restarts held until the memory comes back
        verdict = self.judge.observe(Evidence(probe=gone, now=now, process_alive=False,
                                              exited=exited))
        if verdict.restart:
            verdict = self.restart(verdict)
        self.report(verdict)
        return verdict

    def _observe_server(self, record: Optional[Dict[str, Any]]) -> None:
        """Throughput counters from the heartbeat record, and new crash reports."""
        if self.throughput is not None:
            reading = self.throughput.observe(record)
            if reading is not None:
                if self.metrics is not None:
                    self.metrics.observe_throughput(self.name, reading)
                self._server = {
                    "phase": reading.phase,
                    "in_flight": reading.in_flight,
                    "queued": reading.queued,
                    "running": reading.running,
                    "decode_tok_s": reading.rates.get("decode_tokens"),
                    "prefill_tok_s": reading.rates.get("prefill_tokens"),
                    "last_delivery": reading.last_delivery,
                }
        if self.reports is not None:
            scan = self.reports.scan()
            if self.metrics is not None:
                self.metrics.reports_written(self.name, scan.new)
            if scan.newest is not None:
                self._newest_report = {
                    "file": str(self.reports.folder / scan.newest),
                    "time": scan.newest_time,
                }

    def restart(self, verdict: Verdict) -> Verdict:
        """Restart for verdict, if the policy allows; returns what happened."""
        if self.action is None:
            return replace(verdict, restart=False, reason=f"{verdict.reason}; monitor only")
        if self.stopping:  # a normal stop: not a failure
            return replace(verdict, restart=False, reason=f"{verdict.reason}; stopping")
        held = self.memory_guard.hold_restarts if self.memory_guard is not None else None
        if held:
            # A new server would meet a machine whose memory is gone: no
            # crash loop into it. Restarts resume when the memory comes back.
            return replace(verdict, restart=False, reason=f"{verdict.reason}; restarts held: "
                                                          f"{held}")
        now = self.clock()
        decision = self.policy.check(now)
        if decision.crash_looping:
            # Shown, never obeyed: restarts go on at the backoff's pace.
            verdict = replace(verdict, state=CRASH_LOOPING)
        if not decision.allowed:
            reason = f"{verdict.reason}; {decision.reason}"
            return replace(verdict, restart=False, reason=reason)
        death = self._restart_death
        self._restart_death = None
        if death is None:  # not after a death (a hang): no run of unfixable deaths
            self._note_attention(self.attention.observe(None))
            death = "unknown" if verdict.cause == contract.DEAD_THREAD else None
        self.events.warning(
            "restart",
            f"restarting: {verdict.reason}" + (f" ({decision.reason})" if decision.reason else ""),
            state=verdict.state,
            cause=verdict.cause,
            death_cause=death,
            restarts_in_a_row=self.policy.restarts_in_a_row,
        )
        result = self.action.restart(verdict.reason)
        self.policy.record_restart(now)
        if result.ok:
            self._forget()
        else:
            # Nothing was started: no boot grace, and no "starting" to show.
            self.policy.end_grace(now)
        self.restarts += 1
        self._last_restart = {
            "time": self.wall_clock(),
            "cause": verdict.cause,
            "reason": verdict.reason,
            "ok": result.ok,
            "detail": result.detail,
            "death_cause": death,
        }
        if self.metrics is not None:
            self.metrics.restarted(self.name, verdict.cause, death or "")
        if result.ok:
            self.events.info("restarted", result.detail)
            return replace(verdict, reason=f"{verdict.reason}; restarted")
        self.events.error("restart-failed", result.detail)
        state = verdict.state if verdict.state == CRASH_LOOPING else DOWN
        return replace(verdict, state=state,
                       reason=f"restart failed: {result.detail}; {verdict.reason}")

    # While a server starts (a big model loads for minutes), a line this often.
    PROGRESS_EVERY_S = 30.0

    def report(self, verdict: Verdict, probe: Optional[ProbeResult] = None) -> None:
        """Log a change of state, update the state file and the metrics."""
        previous, self.verdict = self.verdict, verdict
        if previous is None or previous.state != verdict.state:
            self._since = self.wall_clock()
            self._progress_at = self._since
            calm = verdict.state in (HEALTHY, STARTING) or self.stopping
            log = self.events.info if calm else self.events.warning
            log("state", f"{verdict.state}: {verdict.reason}", state=verdict.state)
        elif verdict.state == STARTING:
            self._say_progress(verdict)
        if probe is not None:
            self._last_probe = {
                "status": probe.status,
                "latency_s": probe.latency_s,
                "tokens": probe.tokens,
                "reason": probe.reason,
                "http_status": probe.http_status,
                "time": self.wall_clock(),
            }
            if probe.ok:
                self._last_ok_probe = self._last_probe["time"]
        if self.metrics is not None:
            self.metrics.observe(self.name, probe, verdict.state)
        if self.state is not None:
            self.state.update(self.name, self.record())
            if self.state.error and self.state.error != self._state_error:
                self.events.warning("state-file", self.state.error)
            self._state_error = self.state.error

    def record(self) -> Dict[str, Any]:
        verdict = self.verdict
        return {
            "state": verdict.state if verdict else STARTING,
            "reason": verdict.reason if verdict else "",
            "since": self._since,
            "url": self.url,
            "last_probe": self._last_probe,
            "restarts": self.restarts,
            "last_restart": self._last_restart,
            "last_ok_probe": self._last_ok_probe,
            "server": self._server,
            "newest_report": self._newest_report,
            "warning": self._warning,
            "shim_warning": self._shim_warning,
            "interval_s": self.update_every_s,
            "last_death": self._last_death,
            "needs_attention": self._needs_attention,
            "memory": (self.memory_guard.status.as_record()
                       if self.memory_guard is not None else None),
        }

    # -- death classes (signatures.py) and needs-attention (attention.py) ------

    def _note_death(self) -> None:
        """The process exited: its class (once per exit), for the restart's
        cause label, status, and the run of deaths a restart cannot fix."""
        death_of = getattr(self.process, "death", None)
        death = death_of() if death_of is not None else None
        if not isinstance(death, dict) or death is self._last_death:
            return
        self._last_death = death
        cause = death.get("cause") or "unknown"
        self._restart_death = cause
        self._note_attention(self.attention.observe(cause))

    def _note_recorded_death(self, record: Optional[Dict[str, Any]]) -> None:
        """`watch`: the server's service manager restarts it, so its deaths
        are known from the shim's last heartbeat record (its ``death``), once
        per process: status's last death, and needs attention."""
        death = record.get("death") if isinstance(record, dict) else None
        if not isinstance(death, dict):
            return
        key = (record.get("pid"), death.get("time"))
        if key == self._recorded_death:
            return
        self._recorded_death = key
        from .signatures import cause_of_exit, death_record

        match = cause_of_exit(None, death)
        self._last_death = death_record(match, pid=record.get("pid"), exit_code=None,
                                        time=death.get("time"),
                                        during_startup=death.get("during_startup"))
        self._note_attention(self.attention.observe(match.cls))

    def _note_attention(self, needs: Optional[NeedsAttention]) -> None:
        """Keep status, the log, the metric and the backoff in step with the
        tracker: the remedy is said once per cause, not at every restart."""
        was = self._needs_attention
        if needs is None:
            if was is not None:
                self.events.info("needs-attention",
                                 f"no longer needs attention ({was['cause']})")
                self._needs_attention = None
                self.policy.at_cap = False
                if self.metrics is not None:
                    self.metrics.attention(self.name, None)
            return
        self.policy.at_cap = True
        self._needs_attention = {
            "cause": needs.cause, "remedy": needs.remedy, "starts": needs.starts,
            "since": was["since"] if was and was["cause"] == needs.cause else self.wall_clock(),
            "message": needs.message(),
        }
        if needs.announce:
            self.events.error("needs-attention", needs.message(), cause=needs.cause,
                              remedy=needs.remedy)
        if self.metrics is not None and (was is None or was["cause"] != needs.cause):
            self.metrics.attention(self.name, needs.cause)

    def _served(self) -> None:
        """A good probe: whatever killed the earlier starts is fixed."""
        self.attention.served()
        if self._needs_attention is not None:
            self._note_attention(None)

    SHIM_NOT_LOADED = ("the hotfix shim is not loaded (check PYTHONPATH); exit on death and "
                       "stall detection are off")

    def _note_shim(self, beat: Optional[HeartbeatReading], probe: ProbeResult) -> None:
        """A heartbeat file is configured but the server never beats: it runs
        without the shim (a PYTHONPATH to a folder that is gone), so a death
        would leave a zombie. Said once, loudly, when the boot grace is over
        and the server answers (a shimmed server that answers has beaten
        within a second or so: the idle loop turns about ten times a second)."""
        if not self.expect_shim or self.heartbeat is None:
            return
        fresh = beat is not None and beat.age_s <= self.judge.config.heartbeat_timeout_s
        if fresh:
            if not self._shim_seen and self.metrics is not None:
                self.metrics.shim(self.name, True)
            if self._shim_warning is not None:
                self.events.info("shim", "the hotfix shim is loaded now (heartbeat seen)")
            self._shim_seen, self._shim_warning = True, None
            return
        if self._shim_seen or self._shim_warning is not None:
            return
        if probe.ok and not self.policy.in_grace(self.clock()):
            problem = getattr(self.heartbeat, "problem", None)
            self._shim_warning = self.SHIM_NOT_LOADED + (f" ({problem})" if problem else "")
            self.events.error("shim", self._shim_warning)
            if self.metrics is not None:
                self.metrics.shim(self.name, False)

    def _say_progress(self, verdict: Verdict) -> None:
        """Every PROGRESS_EVERY_S while starting: how long, and what is known."""
        now = self.wall_clock()
        if now - self._progress_at < self.PROGRESS_EVERY_S:
            return
        self._progress_at = now
        phase = (self._server or {}).get("phase")
        what = ("the heartbeat says it is loading the model" if phase == "loading"
                else verdict.reason.removeprefix("boot grace: "))
        self.events.info("loading", f"still starting after {now - self._since:.0f}s: {what}")

    def _note_warning(self, beat: Optional[HeartbeatReading], probe: ProbeResult) -> None:
        """The shim's warning about its install (a pair that dies on the first
        request, a yanked release). The heartbeat outlives the death that
        follows, so it decides when there is one; else the probe's /health."""
        if beat is not None:
            warning = getattr(beat, "warning", None)
        else:
            warning = getattr(probe, "warning", None) or self._warning
        if warning and warning != self._warning:
            self.events.warning("install", warning)
        self._warning = warning

    def _note_abandoned(self, probe: ProbeResult) -> None:
        """Say once (per run) that abandoned probes pile up on the server.

        A probe that stops waiting leaves its request on the server, which
        answers it late or never (a hang): one more per probe interval until
        the server answers or the judge restarts it. Bounded by the judge's
        own budget (docs/operator.md, "Probes in flight"), but said, once.
        """
        if not getattr(probe, "abandoned", False):
            self._abandoned = 0
            return
        self._abandoned += 1
        if self._abandoned == 2:
            self.events.warning(
                "probe", "a probe was abandoned while the previous one may still be in flight "
                "on the server: abandoned probes stay there as requests, one per probe "
                "interval, until it answers them or is restarted")

    def _note_heartbeat_problem(self) -> None:
        """Say once (per change) why the heartbeat is unusable or ignored."""
        problem = getattr(self.heartbeat, "problem", None)
        if problem and problem != self._heartbeat_problem:
            self.events.warning("heartbeat", problem)
        self._heartbeat_problem = problem

    # A process that started up to this long before the (re)start was noted
    # is the new one (the supervisor spawns, then notes the start).
    _START_SLACK_S = 2.0

    def _loaded(self, beat: Optional[HeartbeatReading]) -> bool:
        """The heartbeat is the new server's, and it is loaded and serving."""
        return (
            beat is not None
            and beat.phase in (SERVING, STALLED)
            and beat.started is not None
            and beat.started >= self._boot_wall - self._START_SLACK_S
        )

    def _delivered(self, beat: Optional[HeartbeatReading]) -> bool:
        """The new server's own heartbeat says it delivered tokens."""
        return self._loaded(beat) and bool(beat.delivered)

    def _forget(self) -> None:
        # A new server process: old counters, heartbeat and CPU totals are moot.
        self._boot_wall = self.wall_clock()
        self._warning = None  # the new server says its own
        self._shim_seen = False  # the new server must beat again
        self.judge.reset()
        if self.memory_guard is not None:
            self.memory_guard.server_ended()
        if self.heartbeat is not None:
            self.heartbeat.reset()
        if self.process is not None:
            self.process.reset()
