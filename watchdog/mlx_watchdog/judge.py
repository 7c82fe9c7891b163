"""Judge: busy or wedged? Pure logic, no I/O.

Each tick the judge gets the evidence (the probe result, whether the process
runs, how much CPU it used, the shim's heartbeat) and returns a Verdict: a
state, a short reason, and whether to restart. The rule:

0. The process evidence saw the server exit (a supervised child's exit
   status): **down**, restart at once, even within the boot grace. No probe
   can say more about a process that is gone.
1. A probe that got a token: **healthy**. All counters reset.
2. Within the boot grace after a (re)start: **starting**. Failures do not count.
3. The process is gone, or nothing listens on the port: **down**; restart after
   `failures` consecutive failed probes.
4. The server says its generation thread is gone (503 from /health, or
   "generation thread died" from mlx-lm 0.32): **wedged** after `failures`
   consecutive failed probes, whatever the CPU or heartbeat say. That thread is
   dead and the process idles forever.
5. Any other failed probe (timeout, error, garbage, no tokens) is not, on its
   own, proof of a wedge: a healthy server saturated by long generations (say
   `--decode-concurrency 1 --prompt-concurrency 1` with long requests queued)
   queues the probe behind them and must not be restarted. So the judge looks
   for progress:
   a. Shim heartbeat, authoritative when present. Phase "serving" and
      younger than `heartbeat_timeout`: **busy**, never restarted. Stale
      (no beat for longer than `heartbeat_timeout`): **wedged** at the
      first failed probe, even if the CPU is busy (a loop spinning without
      iterating). One probe is enough because the heartbeat already sums up
      `heartbeat_timeout` seconds of evidence: the loop beats about ten
      times a second when idle and once per decode step when busy, so a
      saturated server keeps beating. Its limit is the longest single step:
      with a huge model whose single prefill step takes longer than
      `heartbeat_timeout`, raise `heartbeat_timeout`. Phase "loading" (the
      shim marks a model load so, at start and when a client asks for
      another model): **busy**, with the limit of (c). The age is the
      heartbeat's own timestamp, kept within what the watchdog saw between
      its reads (heartbeat.py): a jump of the wall clock shifts it by at
      most the time between two reads.
      A probe in flight stops waiting once the heartbeat is past the limit
      (compose.py gives it that check), so a hang is judged about
      `heartbeat_timeout` after it, never one more probe timeout later.
   b. No heartbeat, process CPU known (the process and its children): at
      least `cpu_busy_fraction` of one core over the interval is progress:
      **busy**. Below that for `failures` consecutive failed probes: **wedged**.
   c. Busy on CPU (or loading) with no successful probe for `max_busy`
      seconds since the failures began: **wedged** (0: no limit). Set it above
      the longest queue you expect, or run the shim, whose heartbeat needs no
      limit.
   d. No heartbeat and no process to look at (a remote server): a timeout is
      taken as busy, limited by `max_busy`; a wrong answer (5xx, garbage, no
      tokens) counts towards **wedged** after `failures` in a row.
   e. Heartbeat phase "stalled" (shim: requests in flight and nothing
      delivered for its MLX_HOTFIX_STALL_TIMEOUT, or the loop has not turned
      for that long): **wedged** at the first failed probe, cause "stalled".
      The loop may still turn (a livelock, upstream #1493): beats alone are
      not progress, deliveries are. A saturated server keeps delivering and
      is never stalled.
   f. (Checked before b.) Busy and shedding: the shim's admission part
      refused the probe with its 503 "server_busy" (the queue is full; the
      probe is normally exempt, so this is an older probe or a client
      watching the same way). An answer at all proves the HTTP side lives;
      the answer also says when the server last delivered a token. Within
      `heartbeat_timeout`: **busy**, never restarted, however long the
      storm. Older (or not said): no proof of progress, so it goes on as a
      timeout would (b, c, d): CPU, or busy up to `max_busy`.
      A wedged server is not busy: its loop stops (stale heartbeat) or
      delivers nothing (stalled), and its answers say so.
   Until one of these limits is reached, a failure without progress is
   **failing** (not yet acted on).

The boot grace (2) ends at the first good probe, or as soon as the heartbeat
of the new process says the model is loaded and the loop serving
(monitor.py), so a hang right after start-up is judged within the normal
budget instead of waiting the grace out.

**crash-looping** is not decided here: the restart policy (policy.py) says
when restarts come too often, and the monitor reports it; restarts go on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from . import contract, defaults
from .heartbeat import LOADING, STALLED, HeartbeatReading
from .probe import UNREACHABLE, ProbeResult

STARTING = "starting"
HEALTHY = "healthy"
BUSY = "busy"
FAILING = "failing"
WEDGED = "wedged"
DOWN = "down"
CRASH_LOOPING = "crash-looping"
STATES = (STARTING, HEALTHY, BUSY, FAILING, WEDGED, DOWN, CRASH_LOOPING)

# Causes of a restart: short, fixed strings (they label metrics and alerts),
# the contract's vocabulary (contract.RESTART_CAUSES).
NOT_RUNNING = contract.NOT_RUNNING
UNREACHABLE_CAUSE = contract.UNREACHABLE
DEAD_THREAD = contract.DEAD_THREAD
HEARTBEAT_STALE = contract.HEARTBEAT_STALE
NO_PROGRESS = contract.NO_PROGRESS
BAD_ANSWER = contract.BAD_ANSWER
BUSY_TOO_LONG = contract.BUSY_TOO_LONG
STALLED_CAUSE = contract.STALLED_CAUSE  # requests in flight, nothing delivered (shim heartbeat)
EXITED = contract.EXITED  # the process was seen to exit (a supervised child)
PORT_TAKEN = contract.PORT_TAKEN  # another process holds the server's port


@dataclass(frozen=True)
class JudgeConfig:
    failures: int = defaults.FAILURES
    cpu_busy_fraction: float = defaults.CPU_BUSY_FRACTION
    heartbeat_timeout_s: float = defaults.HEARTBEAT_TIMEOUT_S
    max_busy_s: float = defaults.MAX_BUSY_S


@dataclass(frozen=True)
class Evidence:
    probe: ProbeResult
    now: float  # monotonic seconds
    booting: bool = False  # within the boot grace of a (re)start
    process_alive: Optional[bool] = None  # None: no process to look at
    cpu_s: Optional[float] = None  # CPU seconds used since the previous tick...
    wall_s: Optional[float] = None  # ...over this many seconds
    heartbeat: Optional[HeartbeatReading] = None
    process_problem: Optional[str] = None  # why process_alive is None (e.g. ambiguous)
    port_held_by: Optional[str] = None  # another process holds the port (listener.py)
    exited: Optional[str] = None  # how the process ended, e.g. "exited with code 1"


@dataclass(frozen=True)
class Verdict:
    state: str
    reason: str
    restart: bool = False
    cause: str = ""  # why a restart is wanted, one of the constants above


class Judge:
    def __init__(self, config: JudgeConfig = JudgeConfig()):
        self.config = config
        self.reset()

    def reset(self) -> None:
        """Start afresh, as for a newly started server."""
        self._failures = 0  # consecutive failed probes
        self._stalled = 0  # consecutive failed probes without progress
        self._failing_since: Optional[float] = None

    def observe(self, evidence: Evidence) -> Verdict:
        probe = evidence.probe
        if evidence.exited:
            return Verdict(DOWN, f"server {evidence.exited}", True, EXITED)
        if evidence.port_held_by:
            return self._port_taken(evidence)
        if probe.ok:
            self.reset()
            return Verdict(HEALTHY, f"{probe.tokens} token(s) in {probe.latency_s:.2f}s")
        if evidence.booting:
            return Verdict(STARTING, f"boot grace: {probe.reason}")

        self._failures += 1
        if self._failing_since is None:
            self._failing_since = evidence.now

        if evidence.process_alive is False:
            return self._count(DOWN, DOWN, self._failures, "process not running", NOT_RUNNING)
        if probe.status == UNREACHABLE:
            return self._count(DOWN, DOWN, self._failures, probe.reason, UNREACHABLE_CAUSE)
        if probe.dead_thread:
            return self._count(FAILING, WEDGED, self._failures, probe.reason, DEAD_THREAD)
        return self._look_for_progress(evidence)

    def _look_for_progress(self, evidence: Evidence) -> Verdict:
        probe, beat = evidence.probe, evidence.heartbeat
        if beat is not None and beat.phase == STALLED:
            # The shim has already waited its stall timeout: the verdict is in.
            self._stalled += 1
            waiting = f"{beat.in_flight} request(s) in flight, " if beat.in_flight else ""
            return Verdict(
                WEDGED,
                f"{probe.reason}; heartbeat says stalled ({waiting}nothing delivered)",
                True,
                STALLED_CAUSE,
            )
        if beat is not None and beat.phase == LOADING:
            self._stalled = 0
            return self._busy(evidence, f"{probe.reason}; loading a model")
        if beat is not None:
            limit = self.config.heartbeat_timeout_s
            if beat.age_s <= limit:
                # The shim's heartbeat is authoritative: the loop is iterating.
                self._stalled = 0
                return Verdict(BUSY, f"{probe.reason}; generation loop alive (heartbeat)")
            # No beat for longer than the limit: the loop has not iterated in
            # all that time. That is the evidence `failures` gathers elsewhere.
            self._stalled += 1
            return Verdict(
                WEDGED,
                f"{probe.reason}; heartbeat stale for {beat.age_s:.0f}s (limit {limit:g}s)",
                True,
                HEARTBEAT_STALE,
            )
        age = probe.last_delivery_age_s
        if probe.shedding and age is not None and age <= self.config.heartbeat_timeout_s:
            self._stalled = 0
            return Verdict(BUSY, f"{probe.reason}; busy and shedding load, last delivery "
                                 f"{age:.1f}s ago")
        if evidence.cpu_s is not None and evidence.wall_s:
            share = evidence.cpu_s / evidence.wall_s
            if share >= self.config.cpu_busy_fraction:
                self._stalled = 0
                return self._busy(evidence, f"{probe.reason}; CPU {share:.0%} of a core")
            self._stalled += 1
            return self._count(
                FAILING,
                WEDGED,
                self._stalled,
                f"{probe.reason}; CPU idle ({share:.1%} of a core)",
                NO_PROGRESS,
            )
        if probe.http_status is None or probe.http_status in (502, 504) or probe.shedding:
            # No answer at all (or "busy" without a recent delivery): as
            # likely queued as stuck. Without evidence, give it the benefit
            # of the doubt, up to max_busy.
            missing = evidence.process_problem or "no CPU or heartbeat to check"
            return self._busy(evidence, f"{probe.reason}; {missing}")
        self._stalled += 1
        return self._count(FAILING, WEDGED, self._stalled, probe.reason, BAD_ANSWER)

    def _port_taken(self, evidence: Evidence) -> Verdict:
        # The probe reached someone else: its answer, good or bad, is no
        # evidence about our server, which is not listening. Not healthy,
        # not busy: down.
        reason = str(evidence.port_held_by)
        if evidence.booting:
            return Verdict(DOWN, f"boot grace: {reason}")
        self._failures += 1
        if self._failing_since is None:
            self._failing_since = evidence.now
        return self._count(DOWN, DOWN, self._failures, reason, PORT_TAKEN)

    def _count(self, state: str, final: str, count: int, reason: str, cause: str) -> Verdict:
        needed = self.config.failures
        if count >= needed:
            return Verdict(final, f"{reason} ({count} failed probes in a row)", True, cause)
        return Verdict(state, f"{reason} ({count}/{needed})")

    def _busy(self, evidence: Evidence, reason: str) -> Verdict:
        assert self._failing_since is not None
        busy_for = evidence.now - self._failing_since
        limit = self.config.max_busy_s
        if limit and busy_for >= limit:
            return Verdict(
                WEDGED,
                f"{reason}; no successful probe for {busy_for:.0f}s (max_busy {limit:g}s)",
                True,
                BUSY_TOO_LONG,
            )
        return Verdict(BUSY, reason)
