"""Monitor: one watched server, one `tick()` at a time.

A tick gathers the evidence (probe, process CPU, heartbeat), asks the judge,
restarts through the policy when the judge says so, and reports the outcome
to the log, the state file and the metrics. `supervise` and `watch` both run
monitors; everything a tick touches is injected, so tests drive it with fakes.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Dict, Optional, Protocol

from .act import ActionResult, RestartPolicy
from .heartbeat import SERVING, STALLED, HeartbeatReading, HeartbeatTracker
from .judge import CRASH_LOOPING, HEALTHY, STARTING, Evidence, Judge, Verdict
from .log import Events
from .metrics import Metrics
from .probe import ProbeResult
from .process import ProcessSample
from .redact import redact_url
from .state import StateStore


class RestartAction(Protocol):
    def restart(self, reason: str) -> ActionResult: ...


class ProcessEvidence(Protocol):
    """Like process.CpuSampler: samples the server process each tick."""

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
        process: Optional[ProcessEvidence] = None,
        events: Optional[Events] = None,
        metrics: Optional[Metrics] = None,
        state: Optional[StateStore] = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ):
        self.name = name
        self.probe = probe
        self.judge = judge
        self.policy = policy
        self.action = action
        self.url = redact_url(url)
        self.heartbeat = heartbeat
        self.process = process
        self.events = events or Events(name)
        self.metrics = metrics
        self.state = state
        self.clock = clock
        self.wall_clock = wall_clock
        self.verdict: Optional[Verdict] = None
        self.restarts = 0
        self._since = wall_clock()
        self._last_probe: Optional[Dict[str, Any]] = None
        self._last_restart: Optional[Dict[str, Any]] = None
        self._state_error: Optional[str] = None
        self._boot_wall = wall_clock()  # when the current server was (re)started

    def started(self) -> None:
        """The server (re)started outside of a restart by this monitor."""
        self.policy.started(self.clock())
        self._forget()
        self.report(Verdict(STARTING, "started"))

    def tick(self) -> Verdict:
        probe = self.probe()
        # A failed probe is when CPU time matters: then look for new child
        # processes too (a scan of the whole process table).
        sample = self.process.sample(rescan=not probe.ok) if self.process else ProcessSample()
        beat = self.heartbeat.sample() if self.heartbeat else None
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
            )
        )
        if probe.ok:
            self.policy.healthy(now)
        if verdict.restart:
            verdict = self.restart(verdict)
        self.report(verdict, probe)
        return verdict

    def restart(self, verdict: Verdict) -> Verdict:
        """Restart for verdict, if the policy allows; returns what happened."""
        if self.action is None:
            return replace(verdict, restart=False, reason=f"{verdict.reason}; monitor only")
        now = self.clock()
        decision = self.policy.check(now)
        if not decision.allowed:
            state = CRASH_LOOPING if decision.crash_looping else verdict.state
            reason = f"{verdict.reason}; {decision.reason}"
            return replace(verdict, state=state, restart=False, reason=reason)
        self.events.warning(
            "restart", f"restarting: {verdict.reason}", state=verdict.state, cause=verdict.cause
        )
        result = self.action.restart(verdict.reason)
        self.policy.record_restart(now)
        self._forget()
        self.restarts += 1
        self._last_restart = {
            "time": self.wall_clock(),
            "cause": verdict.cause,
            "reason": verdict.reason,
            "ok": result.ok,
            "detail": result.detail,
        }
        if self.metrics is not None:
            self.metrics.restarted(self.name, verdict.cause)
        if result.ok:
            self.events.info("restarted", result.detail)
            return replace(verdict, reason=f"{verdict.reason}; restarted")
        self.events.error("restart-failed", result.detail)
        return replace(verdict, reason=f"{verdict.reason}; restart failed: {result.detail}")

    def report(self, verdict: Verdict, probe: Optional[ProbeResult] = None) -> None:
        """Log a change of state, update the state file and the metrics."""
        previous, self.verdict = self.verdict, verdict
        if previous is None or previous.state != verdict.state:
            self._since = self.wall_clock()
            calm = verdict.state in (HEALTHY, STARTING)
            log = self.events.info if calm else self.events.warning
            log("state", f"{verdict.state}: {verdict.reason}", state=verdict.state)
        if probe is not None:
            self._last_probe = {
                "status": probe.status,
                "latency_s": probe.latency_s,
                "tokens": probe.tokens,
                "reason": probe.reason,
                "http_status": probe.http_status,
                "time": self.wall_clock(),
            }
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
        }

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

    def _forget(self) -> None:
        # A new server process: old counters, heartbeat and CPU totals are moot.
        self._boot_wall = self.wall_clock()
        self.judge.reset()
        if self.heartbeat is not None:
            self.heartbeat.reset()
        if self.process is not None:
            self.process.reset()
