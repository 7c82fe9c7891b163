"""judge.Judge: pure tables of evidence in, verdicts out."""

from __future__ import annotations

from typing import Iterable, List, Optional

import pytest

from mlx_watchdog.heartbeat import HeartbeatReading
from mlx_watchdog.judge import (
    BAD_ANSWER,
    BUSY,
    BUSY_TOO_LONG,
    DEAD_THREAD,
    DOWN,
    EXITED,
    FAILING,
    HEALTHY,
    HEARTBEAT_STALE,
    NO_PROGRESS,
    NOT_RUNNING,
    STARTING,
    UNREACHABLE_CAUSE,
    WEDGED,
    Evidence,
    Judge,
    JudgeConfig,
    Verdict,
)
from mlx_watchdog.probe import OK, UNHEALTHY, UNREACHABLE, ProbeResult

INTERVAL = 5.0
GOOD = ProbeResult(OK, 0.1, tokens=1, reason="ok", http_status=200)
TIMEOUT = ProbeResult(UNHEALTHY, 10.0, reason="timed out after 10s")
ERROR_500 = ProbeResult(UNHEALTHY, 0.1, reason="HTTP 500: boom", http_status=500)
GATEWAY_504 = ProbeResult(UNHEALTHY, 0.1, reason="HTTP 504", http_status=504)
REFUSED = ProbeResult(UNREACHABLE, 0.01, reason="cannot connect")
HEALTH_503 = ProbeResult(UNHEALTHY, 0.01, reason="/health: 503", http_status=503, dead_thread=True)
DEAD_404 = ProbeResult(
    UNHEALTHY, 0.01, reason="HTTP 404: generation thread died", http_status=404, dead_thread=True
)

CPU_BUSY = 2.0  # seconds of CPU per 5 s interval: 40% of a core
CPU_IDLE = 0.01  # 0.2% of a core


def beat(age: float, phase: str = "serving") -> HeartbeatReading:
    return HeartbeatReading(age_s=age, phase=phase, beats=1, pid=1)


def run(
    probes: Iterable[ProbeResult],
    *,
    cpu: Optional[float] = None,
    heartbeat: Optional[HeartbeatReading] = None,
    alive: Optional[bool] = True,
    booting: bool = False,
    config: JudgeConfig = JudgeConfig(failures=3, max_busy_s=600),
) -> List[Verdict]:
    """One verdict per probe, ticks INTERVAL apart, same evidence each tick."""
    judge = Judge(config)
    verdicts = []
    for i, probe in enumerate(probes):
        verdicts.append(
            judge.observe(
                Evidence(
                    probe=probe,
                    now=i * INTERVAL,
                    booting=booting,
                    process_alive=alive,
                    cpu_s=cpu,
                    wall_s=INTERVAL if cpu is not None else None,
                    heartbeat=heartbeat,
                )
            )
        )
    return verdicts


def states(verdicts: List[Verdict]) -> List[str]:
    return [v.state for v in verdicts]


def restarts(verdicts: List[Verdict]) -> List[bool]:
    return [v.restart for v in verdicts]


def test_a_good_probe_is_healthy_whatever_else():
    [verdict] = run([GOOD], cpu=0.0, heartbeat=beat(999), alive=True)
    assert verdict.state == HEALTHY and not verdict.restart


def test_boot_grace_failures_do_not_count():
    verdicts = run([TIMEOUT] * 10, cpu=CPU_IDLE, booting=True)
    assert set(states(verdicts)) == {STARTING}
    assert not any(restarts(verdicts))


def test_failures_after_grace_start_from_zero():
    judge = Judge(JudgeConfig(failures=2))
    for i in range(5):
        judge.observe(Evidence(TIMEOUT, now=i, booting=True, cpu_s=0.0, wall_s=1.0))
    first = judge.observe(Evidence(TIMEOUT, now=6, cpu_s=0.0, wall_s=1.0))
    second = judge.observe(Evidence(TIMEOUT, now=7, cpu_s=0.0, wall_s=1.0))
    assert (first.state, second.state) == (FAILING, WEDGED)
    assert second.restart


# -- no heartbeat: CPU decides ------------------------------------------------


def test_failing_and_idle_is_wedged_after_n():
    verdicts = run([TIMEOUT] * 3, cpu=CPU_IDLE)
    assert states(verdicts) == [FAILING, FAILING, WEDGED]
    assert restarts(verdicts) == [False, False, True]
    assert verdicts[-1].cause == NO_PROGRESS
    assert "CPU idle" in verdicts[-1].reason


def test_saturated_server_is_busy_and_never_restarted_within_max_busy():
    # --decode-concurrency 1 with long requests queued: every probe times
    # out, the CPU works. 100 ticks = 500 s < max_busy.
    verdicts = run([TIMEOUT] * 100, cpu=CPU_BUSY)
    assert set(states(verdicts)) == {BUSY}
    assert not any(restarts(verdicts))


def test_saturated_server_with_a_heartbeat_is_never_restarted_at_all():
    verdicts = run([TIMEOUT] * 1000, cpu=CPU_BUSY, heartbeat=beat(0.5))
    assert set(states(verdicts)) == {BUSY}
    assert not any(restarts(verdicts))


def test_busy_without_success_is_capped_by_max_busy():
    config = JudgeConfig(failures=3, max_busy_s=60)
    verdicts = run([TIMEOUT] * 14, cpu=CPU_BUSY, config=config)
    # First failure at t=0; t=60 is tick 12.
    assert states(verdicts)[:12] == [BUSY] * 12
    assert verdicts[12].state == WEDGED and verdicts[12].cause == BUSY_TOO_LONG


def test_max_busy_zero_means_no_limit():
    config = JudgeConfig(failures=3, max_busy_s=0)
    verdicts = run([TIMEOUT] * 500, cpu=CPU_BUSY, config=config)
    assert not any(restarts(verdicts))


def test_a_success_resets_the_busy_clock():
    config = JudgeConfig(failures=3, max_busy_s=60)
    probes = ([TIMEOUT] * 10 + [GOOD]) * 5
    assert not any(restarts(run(probes, cpu=CPU_BUSY, config=config)))


def test_progress_resets_the_no_progress_count():
    judge = Judge(JudgeConfig(failures=3))
    cpus = [CPU_IDLE, CPU_IDLE, CPU_BUSY, CPU_IDLE, CPU_IDLE]
    verdicts = [
        judge.observe(Evidence(TIMEOUT, now=i * INTERVAL, cpu_s=c, wall_s=INTERVAL))
        for i, c in enumerate(cpus)
    ]
    assert states(verdicts) == [FAILING, FAILING, BUSY, FAILING, FAILING]


def test_cpu_threshold_is_a_fraction_of_one_core():
    config = JudgeConfig(failures=1, cpu_busy_fraction=0.05)
    assert run([TIMEOUT], cpu=0.26, config=config)[0].state == BUSY  # 5.2%
    assert run([TIMEOUT], cpu=0.24, config=config)[0].state == WEDGED  # 4.8%


# -- the heartbeat is authoritative -------------------------------------------


def test_stale_heartbeat_is_wedged_at_the_first_failed_probe():
    # The heartbeat already holds heartbeat_timeout seconds of evidence:
    # one failed probe is enough, whatever `failures` says.
    [verdict] = run([TIMEOUT], cpu=CPU_IDLE, heartbeat=beat(11))
    assert verdict.state == WEDGED and verdict.restart
    assert verdict.cause == HEARTBEAT_STALE
    assert "heartbeat stale for 11s (limit 10s)" in verdict.reason


def test_stale_heartbeat_is_wedged_even_with_busy_cpu():
    # A loop spinning without iterating: CPU busy, beats stopped.
    [verdict] = run([TIMEOUT], cpu=CPU_BUSY, heartbeat=beat(40))
    assert verdict.state == WEDGED and verdict.restart
    assert verdict.cause == HEARTBEAT_STALE


def test_stale_heartbeat_counts_only_with_a_failed_probe():
    verdicts = run([GOOD] * 5, cpu=CPU_IDLE, heartbeat=beat(999))
    assert set(states(verdicts)) == {HEALTHY}


def test_stale_heartbeat_during_boot_grace_is_starting():
    verdicts = run([TIMEOUT] * 5, heartbeat=beat(999), booting=True)
    assert set(states(verdicts)) == {STARTING} and not any(restarts(verdicts))


def test_default_heartbeat_timeout_is_10s():
    assert JudgeConfig().heartbeat_timeout_s == 10.0
    judge = Judge(JudgeConfig())
    assert judge.observe(Evidence(TIMEOUT, now=0, heartbeat=beat(10.0))).state == BUSY
    assert judge.observe(Evidence(TIMEOUT, now=5, heartbeat=beat(10.5))).restart


def test_failures_still_govern_the_paths_without_a_heartbeat():
    config = JudgeConfig(failures=4)
    assert restarts(run([TIMEOUT] * 4, cpu=CPU_IDLE, config=config)) == [False] * 3 + [True]
    assert restarts(run([DEAD_404] * 4, heartbeat=beat(50), config=config)) == (
        [False] * 3 + [True]
    )
    assert restarts(run([REFUSED] * 4, heartbeat=beat(50), config=config)) == (
        [False] * 3 + [True]
    )


def test_a_fresh_heartbeat_is_busy_even_with_idle_cpu():
    verdicts = run([TIMEOUT] * 50, cpu=CPU_IDLE, heartbeat=beat(0.5))
    assert set(states(verdicts)) == {BUSY}


def test_a_heartbeat_within_the_timeout_counts():
    verdicts = run([TIMEOUT] * 5, cpu=CPU_IDLE, heartbeat=beat(3))
    assert set(states(verdicts)) == {BUSY}


def test_the_age_decides_not_whether_the_beats_moved():
    # The loop beat just after the previous read, then hung: the beats
    # moved, but the last one is older than the limit (the tracker keeps the
    # age within what it saw between reads, so a clock jump cannot do this).
    [verdict] = run([TIMEOUT], heartbeat=beat(12))
    assert verdict.state == WEDGED and verdict.cause == HEARTBEAT_STALE


def test_loading_phase_is_busy_up_to_max_busy():
    config = JudgeConfig(failures=3, max_busy_s=60)
    loading = beat(50, "loading")  # written once as loading began
    verdicts = run([TIMEOUT] * 14, cpu=CPU_IDLE, heartbeat=loading, config=config)
    assert states(verdicts)[:12] == [BUSY] * 12
    assert verdicts[12].state == WEDGED and verdicts[12].cause == BUSY_TOO_LONG


def test_heartbeat_timeout_is_configurable():
    config = JudgeConfig(failures=1, heartbeat_timeout_s=100)
    assert run([TIMEOUT], heartbeat=beat(40), config=config)[0].state == BUSY
    assert run([TIMEOUT], heartbeat=beat(101), config=config)[0].state == WEDGED


# -- definite signals ---------------------------------------------------------


@pytest.mark.parametrize("probe", [HEALTH_503, DEAD_404])
@pytest.mark.parametrize("cpu, heartbeat", [(CPU_BUSY, None), (CPU_IDLE, None), (None, None),
                                            (CPU_BUSY, beat(0.1))])
def test_dead_thread_is_wedged_after_n_whatever_the_cpu(probe, cpu, heartbeat):
    verdicts = run([probe] * 3, cpu=cpu, heartbeat=heartbeat)
    assert states(verdicts) == [FAILING, FAILING, WEDGED]
    assert verdicts[-1].restart and verdicts[-1].cause == DEAD_THREAD


def test_unreachable_is_down_and_restarted_after_n():
    verdicts = run([REFUSED] * 3, alive=None)
    assert states(verdicts) == [DOWN, DOWN, DOWN]
    assert restarts(verdicts) == [False, False, True]
    assert verdicts[-1].cause == UNREACHABLE_CAUSE


def test_process_gone_is_down_even_if_probes_time_out():
    verdicts = run([TIMEOUT] * 3, alive=False)
    assert states(verdicts) == [DOWN, DOWN, DOWN]
    assert verdicts[-1].restart and verdicts[-1].cause == NOT_RUNNING


def test_failures_of_any_kind_add_up_for_down():
    verdicts = run([TIMEOUT, TIMEOUT, REFUSED], cpu=CPU_IDLE)
    assert verdicts[-1].state == DOWN and verdicts[-1].restart


# -- no evidence at all (a remote server) -------------------------------------


def test_remote_timeouts_are_given_the_benefit_of_the_doubt():
    verdicts = run([TIMEOUT] * 20, alive=None)
    assert set(states(verdicts)) == {BUSY}


def test_remote_gateway_timeouts_count_as_no_answer():
    assert set(states(run([GATEWAY_504] * 20, alive=None))) == {BUSY}


def test_remote_wrong_answers_are_wedged_after_n():
    verdicts = run([ERROR_500] * 3, alive=None)
    assert states(verdicts) == [FAILING, FAILING, WEDGED]
    assert verdicts[-1].cause == BAD_ANSWER


def test_remote_busy_is_capped_by_max_busy():
    config = JudgeConfig(failures=3, max_busy_s=30)
    verdicts = run([TIMEOUT] * 8, alive=None, config=config)
    assert WEDGED in states(verdicts)


# -- bookkeeping ----------------------------------------------------------------


def test_reset_forgets_the_count():
    judge = Judge(JudgeConfig(failures=2))
    judge.observe(Evidence(TIMEOUT, now=0, cpu_s=0.0, wall_s=5.0))
    judge.reset()
    assert judge.observe(Evidence(TIMEOUT, now=5, cpu_s=0.0, wall_s=5.0)).state == FAILING


def test_reasons_are_short_and_say_how_far_along():
    verdicts = run([TIMEOUT] * 3, cpu=CPU_IDLE)
    assert "(1/3)" in verdicts[0].reason
    assert "3 failed probes in a row" in verdicts[2].reason
    assert all(len(v.reason) < 300 for v in verdicts)


# -- delivery: the shim's "stalled" phase ------------------------------------------


def test_a_stalled_heartbeat_is_wedged_at_the_first_failed_probe_though_fresh():
    from mlx_watchdog.judge import STALLED_CAUSE

    stalled = HeartbeatReading(age_s=0.5, phase="stalled", beats=9, pid=1,
                               in_flight=2)
    [verdict] = run([TIMEOUT], cpu=CPU_BUSY, heartbeat=stalled)
    assert verdict.state == WEDGED and verdict.restart and verdict.cause == STALLED_CAUSE
    assert "stalled" in verdict.reason and "2 request(s) in flight" in verdict.reason


def test_a_stalled_heartbeat_with_a_good_probe_is_healthy():
    stalled = HeartbeatReading(age_s=0.5, phase="stalled", beats=9, pid=1)
    [verdict] = run([GOOD], heartbeat=stalled)
    assert verdict.state == HEALTHY and not verdict.restart


def test_a_stalled_heartbeat_in_the_boot_grace_is_starting():
    stalled = HeartbeatReading(age_s=0.5, phase="stalled", beats=9, pid=1)
    [verdict] = run([TIMEOUT], heartbeat=stalled, booting=True)
    assert verdict.state == STARTING and not verdict.restart


def test_a_process_seen_to_exit_is_down_at_once_whatever_else_the_evidence_says():
    # Only the process evidence can say so (a supervisor reaping its child);
    # no probe, boot grace or heartbeat outweighs it.
    for probe, booting in ((GOOD, False), (TIMEOUT, True), (TIMEOUT, False)):
        verdict = Judge(JudgeConfig(failures=3)).observe(
            Evidence(probe, now=0, booting=booting, heartbeat=beat(0.5),
                     exited="exited with code 1"))
        assert (verdict.state, verdict.restart, verdict.cause) == (DOWN, True, EXITED)
        assert verdict.reason == "server exited with code 1"


# -- busy and shedding (the shim's admission part refused the probe) ---------------------

BUSY_BODY = "HTTP 503: the server is busy: 2 requests already wait for 1 slot"


def shedding(last_delivery_age_s: Optional[float]) -> ProbeResult:
    return ProbeResult(UNHEALTHY, 0.01, reason=BUSY_BODY, http_status=503, shedding=True,
                       last_delivery_age_s=last_delivery_age_s)


def test_busy_and_shedding_while_delivering_is_busy_however_long_the_storm():
    # No heartbeat, no CPU figure, an hour of 503s: the answers say tokens flow.
    verdicts = run([shedding(0.2)] * 720, alive=None)
    assert set(states(verdicts)) == {BUSY} and not any(v.restart for v in verdicts)
    assert "busy and shedding load, last delivery 0.2s ago" in verdicts[-1].reason
    # With the process idle on CPU too: the answer is the better evidence.
    assert set(states(run([shedding(1.0)] * 10, cpu=CPU_IDLE))) == {BUSY}


def test_shedding_without_a_recent_delivery_is_no_proof_of_progress():
    # Nothing delivered for longer than heartbeat_timeout: taken as a timeout
    # would be, so CPU decides, or max_busy bounds it.
    idle = run([shedding(60.0)] * 3, cpu=CPU_IDLE)
    assert states(idle) == [FAILING, FAILING, WEDGED] and idle[-1].cause == NO_PROGRESS
    bounded = run([shedding(None)] * 200, alive=None,
                  config=JudgeConfig(failures=3, max_busy_s=600))
    assert states(bounded)[:3] == [BUSY] * 3
    assert bounded[-1].state == WEDGED and bounded[-1].cause == BUSY_TOO_LONG


def test_a_plain_503_is_not_shedding():
    # A 503 that is not the shim's "busy" (a dying server, a proxy) counts as before.
    plain = ProbeResult(UNHEALTHY, 0.01, reason="HTTP 503: stopping", http_status=503,
                        last_delivery_age_s=None)
    assert states(run([plain] * 3, alive=None)) == [FAILING, FAILING, WEDGED]


def test_a_wedged_loop_behind_a_busy_answer_is_still_wedged():
    # The heartbeat outranks the answer: stale or stalled is wedged at once.
    stale = run([shedding(0.2)], heartbeat=beat(30.0))
    assert stale[0].state == WEDGED and stale[0].cause == HEARTBEAT_STALE
    stalled = run([shedding(0.2)], heartbeat=beat(0.5, phase="stalled"))
    assert stalled[0].state == WEDGED and stalled[0].restart
    fresh = run([shedding(0.2)] * 10, heartbeat=beat(0.5))
    assert set(states(fresh)) == {BUSY}
