"""The composition root: one Monitor from one InstanceConfig.

`watch` builds a monitor for each configured instance, `supervise` one for
its child, both here, so the two read the same options the same way. What
differs is injected: how the server process is found (process evidence, the
heartbeat's owner, the port's listener) and how it is restarted.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from . import defaults, reports
from .config import InstanceConfig
from .group_heartbeats import heartbeat_tracker
from .heartbeat import SERVING, STALLED, read_heartbeat
from .judge import Judge, JudgeConfig
from .keep_awake import KeepAwake
from .log import Events
from .memory import Machine, format_bytes, parse_memory_limit, resolve_limit
from .memory_guard import MemoryGuard, Readers, guard_config
from .metrics import Metrics
from .monitor import Monitor, ProcessEvidence, RestartAction
from .policy import RestartPolicy
from .probe import Probe, ProbeResult
from .state import StateStore
from .report_watcher import ReportWatcher
from .throughput import ThroughputTracker


def judge_config(instance: InstanceConfig) -> JudgeConfig:
    return JudgeConfig(
        failures=instance.failures,
        cpu_busy_fraction=instance.cpu_busy,
        heartbeat_timeout_s=instance.heartbeat_timeout,
        max_busy_s=instance.max_busy,
    )


def restart_policy(instance: InstanceConfig) -> RestartPolicy:
    return RestartPolicy(
        boot_grace_s=instance.boot_grace,
        max_restarts=instance.max_restarts,
        window_s=instance.restart_window,
        backoff_max_s=instance.backoff_max,
    )


def build_monitor(
    instance: InstanceConfig,
    *,
    action: Optional[RestartAction],  # None: watch and report, never restart
    process: Optional[ProcessEvidence] = None,
    owner: Optional[Callable[[], Optional[int]]] = None,  # the server's pid, for its heartbeat
    listener: Optional[Callable[[ProbeResult], Optional[str]]] = None,
    probe: Optional[Callable[[], ProbeResult]] = None,  # tests: instead of probing the URL
    policy: Optional[RestartPolicy] = None,  # tests: instead of the instance's
    metrics: Optional[Metrics] = None,
    state: Optional[StateStore] = None,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
    expect_shim: Optional[bool] = None,  # default: when a heartbeat file is configured
    machine: Optional[Callable[[], "Machine"]] = None,  # tests: instead of macos.machine
) -> Monitor:
    heartbeat_file = instance.heartbeat_file
    # Every rank's heartbeat when the server is an mlx.launch group (group_heartbeats.py).
    heartbeat = heartbeat_tracker(heartbeat_file, owner=owner) if heartbeat_file else None
    events = Events(instance.name)
    return Monitor(
        instance.name,
        probe or Probe(
            instance.url,
            timeout=instance.timeout,
            model=instance.model,
            api_key=instance.api_key,
            check_health=instance.health_check,
            cacert=instance.cacert,
            give_up=_stale_heartbeat(heartbeat, instance.heartbeat_timeout) if heartbeat else None,
        ),
        judge=Judge(judge_config(instance)),
        policy=policy or restart_policy(instance),
        action=action,
        url=instance.url,
        heartbeat=heartbeat,
        heartbeat_file=heartbeat_file,
        process=process,
        listener=listener,
        events=events,
        metrics=metrics,
        state=state,
        throughput=ThroughputTracker() if heartbeat_file else None,
        reports=ReportWatcher(reports.report_dir(instance.report_dir), instance.name,
                              _port(instance.url)),
        clock=clock,
        wall_clock=wall_clock,
        # A tick lasts at most a probe; the state file says so, for `status`.
        update_every_s=instance.interval + instance.timeout,
        expect_shim=expect_shim,
        memory_guard=memory_guard(instance, events=events, metrics=metrics, owner=owner,
                                  clock=clock, wall_clock=wall_clock, machine=machine),
        keep_awake=KeepAwake(events) if instance.caffeinate else None,
    )


def memory_guard(instance: InstanceConfig, *, events: Events, metrics: Optional[Metrics],
                 owner: Optional[Callable[[], Optional[int]]], clock: Callable[[], float],
                 wall_clock: Callable[[], float],
                 machine: Optional[Callable[[], "Machine"]] = None,
                 readers: Optional[Readers] = None) -> Optional[MemoryGuard]:
    """The instance's memory guard, or None (no limit known: off). Says which,
    once, with how the limit was worked out."""
    spec = parse_memory_limit(instance.memory_limit)
    if spec.kind == "off":
        return None
    if machine is None:
        from .macos import machine
    limit = resolve_limit(spec, machine())
    if limit.bytes is None:
        if spec.kind == "auto" and instance.memory_limit == defaults.MEMORY_LIMIT:
            return None  # the default, off here: nothing to say on every start
        events.info("memory", limit.reason)
        return None
    if instance.heartbeat_file is None and owner is None:
        events.warning("memory", f"memory_limit {instance.memory_limit}: the memory guard "
                                 "finds the server through the shim's heartbeat; set "
                                 "heartbeat_file (install does), or it measures nothing")
    config = guard_config(limit.bytes, horizon_s=instance.memory_horizon,
                          idle_wait_s=instance.memory_idle_wait)
    events.info("memory", f"memory guard on: {limit.reason}; soft line "
                          f"{format_bytes(int(config.soft_line))}, hard line "
                          f"{format_bytes(int(config.hard_line))}, horizon "
                          f"{instance.memory_horizon / 3600:g} h")
    return MemoryGuard(
        instance.name, config, heartbeat_file=instance.heartbeat_file,
        report_dir=reports.report_dir(instance.report_dir), events=events, metrics=metrics,
        limit_reason=limit.reason, pid=owner, interval_s=instance.interval, readers=readers,
        instance=reports.instance_field(instance.name, instance.url), clock=clock,
        wall_clock=wall_clock)


def _port(url: str) -> Optional[int]:
    from urllib.parse import urlsplit

    try:
        return urlsplit(url).port
    except ValueError:
        return None


def _stale_heartbeat(heartbeat, limit_s: float,
                     clock: Callable[[], float] = time.time) -> Callable[[], Optional[str]]:
    """For the probe: stop waiting once the shim's heartbeat is staler than the
    judge's limit (or says stalled). The judge would call that wedged at the
    probe's timeout anyway; a probe sent just before a hang no longer makes
    the verdict wait one more probe timeout.

    It runs on the probe's give-up thread while the monitor's thread owns the
    tracker, so it never touches the tracker: it reads each file itself, and
    trusts a beat only from the writer the monitor accepted at its last tick
    (`accepted`, replaced whole by the monitor). Its age is the file's own
    timestamp: a wall clock that jumps can cut one probe short, never restart
    a server (the judge ages the beat on the monitor's clock)."""

    def why() -> Optional[str]:
        for path, pid in heartbeat.accepted.items():
            beat = read_heartbeat(path)
            if beat is None or beat.pid != pid:
                continue
            if beat.phase == STALLED:
                return "the heartbeat says stalled"
            age = clock() - beat.time
            if beat.phase == SERVING and age > limit_s:
                return f"the heartbeat is {age:.0f}s old (limit {limit_s:g}s)"
        return None

    return why
