"""policy: boot grace, backoff that never gives up, crash-loop state (pure, fake time)."""

import pytest

from mlx_watchdog.policy import RestartPolicy


def policy(**kwargs) -> RestartPolicy:
    options = dict(boot_grace_s=60, backoff_initial_s=1, backoff_max_s=8,
                   max_restarts=5, window_s=300)
    options.update(kwargs)
    return RestartPolicy(**options)


def restart_when_allowed(p: RestartPolicy, now: float) -> float:
    """Ask until allowed; returns when the restart happened."""
    decision = p.check(now)
    if not decision.allowed:
        now += decision.wait_s
        assert p.check(now).allowed
    p.record_restart(now)
    return now


def test_boot_grace_after_start_and_restart():
    p = policy()
    assert not p.in_grace(0)
    p.started(0)
    assert p.in_grace(59.9) and not p.in_grace(60)
    p.record_restart(100)
    assert p.in_grace(159) and not p.in_grace(160)


def test_a_healthy_probe_ends_the_grace_early():
    p = policy()
    p.started(0)
    p.healthy(1)
    assert not p.in_grace(2)


def test_first_restart_is_immediate_then_doubles_up_to_the_cap_counted_from_the_failure():
    p = policy(max_restarts=100)
    now, waits = 0.0, []
    for _ in range(8):
        now += 30  # the server lived 30 s, then failed
        decision = p.check(now)
        waits.append(0.0 if decision.allowed else round(decision.wait_s, 6))
        now = restart_when_allowed(p, now)
    assert waits == [0.0, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0]


def test_crash_looping_is_shown_but_never_pauses_restarts():
    p = policy(backoff_initial_s=1, backoff_max_s=60, max_restarts=5)
    now, looping = 0.0, []
    for _ in range(200):  # far past any per-window limit
        now += 1
        failed_at = now
        decision = p.check(now)
        looping.append(decision.crash_looping)
        now = restart_when_allowed(p, now)
        assert now - failed_at <= 60  # never paused longer than the cap
    assert looping[-1] and not looping[0]
    assert "crash-looping" in p.check(now + 1).reason


def test_a_start_that_served_makes_the_next_restart_immediate():
    # A server that dies about once a minute and serves in between: every
    # restart at once, not after 1, 2, 4, 8... s (a restart costs seconds).
    p = policy(max_restarts=100)
    now = 0.0
    for _ in range(10):
        now += 60
        decision = p.check(now)
        assert decision.allowed and decision.wait_s == 0
        p.record_restart(now)
        p.healthy(now + 2)  # the new server served
    assert p.restarts_in_a_row == 0


def test_a_good_probe_after_a_crash_loop_ends_the_backoff():
    p = policy()
    now = 0.0
    for _ in range(4):
        now = restart_when_allowed(p, now + 1)
    assert p.backoff_s() == 8
    p.healthy(now + 5)
    assert p.restarts_in_a_row == 0
    assert p.check(now + 6).allowed


def test_a_heartbeat_that_delivered_counts_as_served():
    p = policy()
    now = 0.0
    for _ in range(3):
        now = restart_when_allowed(p, now + 1)
    p.served(now + 3)  # between probes: the heartbeat says the new server delivered
    assert p.check(now + 4).allowed


def test_starts_that_never_serve_keep_backing_off():
    p = policy(max_restarts=100)
    now = 0.0
    for _ in range(3):
        now = restart_when_allowed(p, now + 1)
    p.end_grace(now + 2)  # loaded, but never served a token: no reset
    assert not p.check(now + 3).allowed
    assert p.backoff_s() == 4


def test_serving_in_between_still_shows_crash_looping():
    p = policy(max_restarts=5, window_s=300)
    now = 0.0
    for _ in range(5):
        now += 10
        p.check(now)
        p.record_restart(now)
        p.healthy(now + 1)
    decision = p.check(now + 5)
    assert decision.allowed and decision.crash_looping


def test_a_zero_cap_means_no_wait():
    p = policy(backoff_max_s=0)
    for t in range(10):
        assert p.check(t).allowed
        p.record_restart(t)


def test_negative_backoff_is_refused():
    with pytest.raises(ValueError):
        RestartPolicy(backoff_max_s=-1)
