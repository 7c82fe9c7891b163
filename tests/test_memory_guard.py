"""The memory guard's pure pieces: the limit, the measure, the request file
(both sides of the seam: the watchdog writes, the shim reads), and the
judge (soft, hard, trend, the idle wait) and the wired-memory verdict."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from harness.server import SHIM_DIR, base_env
from mlx_watchdog import memory_judge as mj
from mlx_watchdog.memory import (
    GiB, MiB, TiB, HeartbeatMemory, LimitSpec, Machine, MemoryLimitError, clear_request,
    measure, parse_duration, parse_heartbeat_memory, parse_memory_limit, request_path,
    resolve_limit, tree_rss, write_request,
)

# -- memory_limit / --memory-limit ----------------------------------------------------------


@pytest.mark.parametrize("text, kind, value", [
    ("48G", "bytes", 48 * GiB), ("48g", "bytes", 48 * GiB), ("48GB", "bytes", 48 * GiB),
    ("48GiB", "bytes", 48 * GiB), ("48 G", "bytes", 48 * GiB), ("512M", "bytes", 512 * MiB),
    ("1.5T", "bytes", int(1.5 * TiB)), ("65536K", "bytes", 64 * MiB),
    ("2000000000", "bytes", 2_000_000_000), (2_000_000_000, "bytes", 2_000_000_000),
    ("80%", "share", 0.8), ("12.5%", "share", 0.125), ("100%", "share", 1.0),
    ("auto", "auto", 0), ("AUTO", "auto", 0), ("off", "off", 0), (" off ", "off", 0),
])
def test_limits_that_parse(text, kind, value):
    spec = parse_memory_limit(text)
    assert (spec.kind, spec.value) == (kind, pytest.approx(value))


@pytest.mark.parametrize("text, says", [
    ("48X", "memory limit '48X': unknown unit 'X'; use bytes with a unit (48G, 512M, 1.5T), "
            "a share of RAM (80%), auto or off"),
    ("lots", "memory limit 'lots': not a size; use bytes with a unit"),
    ("-4G", "memory limit '-4G': not a size"),
    ("0%", "a share of RAM must be above 0% and at most 100%"),
    ("150%", "a share of RAM must be above 0% and at most 100%"),
    ("48", "memory limit '48' is 48 bytes, less than 1 MiB: did you mean 48G?"),
    ("", "memory limit '': not a size"),
    (True, "memory limit True: expected text"),
])
def test_bad_limits_name_the_fix(text, says):
    with pytest.raises(MemoryLimitError) as caught:
        parse_memory_limit(text)
    assert says in str(caught.value)


def test_a_share_needs_the_ram_size_and_bytes_do_not():
    machine = Machine("linux", ram_bytes=24 * GiB)
    limit = resolve_limit(parse_memory_limit("80%"), machine)
    assert limit.bytes == int(24 * GiB * 0.8) and "80% of 24.0G RAM" in limit.reason
    with pytest.raises(MemoryLimitError, match="RAM is unknown; give bytes instead"):
        resolve_limit(parse_memory_limit("80%"), Machine("linux"))
    assert resolve_limit(parse_memory_limit("48G"), Machine("linux")).bytes == 48 * GiB
    assert resolve_limit(parse_memory_limit("off"), Machine("darwin", 64 * GiB)).bytes is None


def test_auto_is_off_on_linux_and_says_how_to_guard_anyway():
    limit = resolve_limit(LimitSpec("auto"), Machine("linux", ram_bytes=24 * GiB))
    assert limit.bytes is None and "--memory-limit 48G" in limit.reason


@pytest.mark.parametrize("text, seconds", [
    ("6h", 21600), ("30m", 1800), ("90s", 90), ("1.5h", 5400), ("1d", 86400), (300, 300),
    ("300", 300), (0.5, 0.5)])
def test_durations(text, seconds):
    assert parse_duration(text, "memory_horizon") == seconds


@pytest.mark.parametrize("text", ["soon", "-5m", "0", 0, "6 hours", float("inf")])
def test_bad_durations_name_the_key(text):
    with pytest.raises(ValueError, match="memory_horizon"):
        parse_duration(text, "memory_horizon")


# -- the measure --------------------------------------------------------------------------


def test_the_measure_prefers_the_footprint_and_is_never_below_mlx_active():
    beat = HeartbeatMemory(rss=10 * GiB, phys_footprint=40 * GiB, mlx_active=30 * GiB)
    assert measure(footprint=41 * GiB, heartbeat=beat, tree_rss=12 * GiB).bytes == 41 * GiB
    assert measure(heartbeat=beat, tree_rss=12 * GiB).source == "phys_footprint (heartbeat)"
    linux = HeartbeatMemory(rss=10 * GiB, mlx_active=30 * GiB)
    # RSS leaves GPU buffers out on a Mac; mlx_active counts them.
    assert measure(heartbeat=linux, tree_rss=12 * GiB) == measure(
        heartbeat=HeartbeatMemory(mlx_active=30 * GiB))
    assert measure(heartbeat=linux, tree_rss=12 * GiB).source == "mlx_active (heartbeat)"
    assert measure(heartbeat=HeartbeatMemory(rss=3 * GiB), tree_rss=5 * GiB).source == (
        "RSS of the process tree")
    assert measure(heartbeat=HeartbeatMemory(rss=3 * GiB)).bytes == 3 * GiB
    assert measure() is None


def test_the_process_tree_rss():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        alone = measure(tree_rss=tree_rss(child.pid)).bytes
        assert alone > 1 * MiB
        assert tree_rss(os.getpid()) > alone  # this process and its child
    finally:
        child.kill()
        child.wait()
    assert tree_rss(child.pid) is None


def test_the_heartbeat_memory_object_is_validated():
    parsed = parse_heartbeat_memory({
        "rss": 100, "phys_footprint": True, "mlx_active": -1, "mlx_cache": "7",
        "mlx_peak": 300, "prompt_cache_bytes": 2.5, "prompt_cache_entries": 4,
        "trimmed": {"request": 3, "time": 1.0, "prompt_cache_bytes": 50, "mlx_cache_bytes": 7}})
    assert parsed == HeartbeatMemory(rss=100, mlx_peak=300, prompt_cache_entries=4,
                                     trimmed_request=3, trimmed_bytes=57)
    assert parse_heartbeat_memory(None) is None and parse_heartbeat_memory([1]) is None
    assert parse_heartbeat_memory({"trimmed": {"request": "3"}}) == HeartbeatMemory()


# -- the request file: written here, read by the shim -------------------------------------

READ_BY_THE_SHIM = (
    "import json, sys; from mlx_hotfix import memory; "
    "print(json.dumps(memory.read_request(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))))")


def _shim_reads(path, pid, now):
    result = subprocess.run([sys.executable, "-c", READ_BY_THE_SHIM, path, str(pid), str(now)],
                            env=base_env(extra={"PYTHONPATH": str(SHIM_DIR)}),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_shim_reads_the_request_the_watchdog_writes(tmp_path):
    beat = tmp_path / "server.heartbeat"
    path = write_request(beat, pid=4242, trim=2, soft_until=1000.25)
    assert path == request_path(beat) == f"{beat}.memory"
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"
    assert _shim_reads(path, 4242, 990.0) == {"trim": 2, "soft_until": 1000.25}
    assert _shim_reads(path, 4243, 990.0) is None  # another server process
    write_request(beat, pid=4242, soft_until=1000.0)
    assert _shim_reads(path, 4242, 990.0) == {"trim": None, "soft_until": 1000.0}
    clear_request(beat)
    clear_request(beat)  # twice is fine
    assert not os.path.exists(path)


# -- the judge -------------------------------------------------------------------------------

LIMIT = 100 * GiB


def judge(**overrides):
    return mj.MemoryJudge(mj.MemoryGuardConfig(limit_bytes=LIMIT, **overrides))


def test_under_the_soft_line_nothing_happens():
    decision = judge().observe(0, 50 * GiB, in_flight=3)
    assert decision.state == mj.OK and not (decision.soft or decision.trim or decision.restart)
    assert decision.share == 0.5 and decision.reason == "50.0G of 100.0G (50%)"


def test_the_soft_line_asks_for_a_trim_and_a_503_until_memory_falls_back():
    guard = judge(trim_repeat_s=600)
    first = guard.observe(0, 86 * GiB, in_flight=1)
    assert first.state == mj.MEMORY_SOFT and first.soft and first.trim and not first.restart
    assert "over the soft line (85%)" in first.reason
    assert guard.observe(5, 88 * GiB).trim is False  # asked once ...
    assert guard.observe(600, 88 * GiB).trim is True  # ... and again after trim_repeat_s
    cleared = guard.observe(605, 80 * GiB)
    assert cleared.state == mj.OK and not cleared.soft
    assert guard.observe(610, 86 * GiB).trim is True  # a new crossing asks at once


def test_the_hard_line_restarts_at_the_first_idle_moment():
    guard = judge(idle_wait_s=300)
    busy = guard.observe(0, 96 * GiB, in_flight=2)
    assert busy.state == mj.MEMORY_HARD and busy.soft and busy.restart_pending
    assert not busy.restart and busy.trigger == "hard" and "at most 300s more" in busy.reason
    assert guard.observe(100, 96 * GiB, in_flight=1).restart is False
    idle = guard.observe(120, 96 * GiB, in_flight=0)
    assert idle.restart and idle.cause == "memory" and "nothing in flight" in idle.reason


def test_the_hard_line_restarts_at_once_after_the_idle_wait():
    guard = judge(idle_wait_s=300)
    guard.observe(0, 96 * GiB, in_flight=2)
    assert guard.observe(299, 96 * GiB, in_flight=2).restart is False
    late = guard.observe(300, 96 * GiB, in_flight=2)
    assert late.restart and "no idle moment in 300s" in late.reason
    unknown = judge(idle_wait_s=300)
    assert unknown.observe(0, 96 * GiB, in_flight=None).restart is False
    assert unknown.observe(300, 96 * GiB, in_flight=None).restart is True


def test_at_the_limit_itself_there_is_no_wait():
    decision = judge().observe(0, LIMIT, in_flight=5)
    assert decision.restart and decision.trigger == "limit" and "at once" in decision.reason


def test_a_restart_no_longer_wanted_once_memory_falls_back():
    guard = judge(idle_wait_s=300)
    guard.observe(0, 96 * GiB, in_flight=2)
    fell = guard.observe(10, 90 * GiB, in_flight=2)  # a trim freed enough
    assert not fell.restart_pending and fell.state == mj.MEMORY_SOFT
    again = guard.observe(20, 96 * GiB, in_flight=2)  # the wait starts afresh
    assert again.restart_pending and not guard.observe(310, 96 * GiB, in_flight=2).restart
    assert guard.observe(320, 96 * GiB, in_flight=2).restart


def test_no_measure_is_no_decision():
    guard = judge()
    guard.observe(0, 96 * GiB, in_flight=2)
    blind = guard.observe(5, None)
    assert blind.state == mj.UNKNOWN and blind.restart_pending and not blind.restart


# -- the trend, on recorded samples -----------------------------------------------------------

def recording(start_gib, gib_per_hour, *, minutes=60, every_s=5, plateau_after_min=None):
    """Samples every every_s seconds, with a deterministic wobble of +-0.3 GiB
    (the prompt cache filling and being trimmed)."""
    samples = []
    for i in range(int(minutes * 60 / every_s) + 1):
        t = i * every_s
        grown_for = t if plateau_after_min is None else min(t, plateau_after_min * 60)
        value = start_gib + gib_per_hour * grown_for / 3600 + 0.3 * math.sin(i * 0.7)
        samples.append((float(t), value * GiB))
    return samples


def replay(guard, samples, in_flight=1):
    decision = None
    for t, value in samples:
        decision = guard.observe(t, int(value), in_flight=in_flight)
    return decision


def test_a_steady_leak_is_caught_hours_before_the_hard_line():
    # 50 GiB, +6 GiB an hour: the hard line (95 GiB) is 7.5 h away at the
    # start; with a 6 h horizon a restart is wanted once it is under 6 h away,
    # at about 59 GiB, an hour and a half in.
    guard = judge(horizon_s=6 * 3600, idle_wait_s=300)
    samples = recording(50, 6, minutes=120)
    first_hour = replay(guard, samples[:721])
    assert first_hour.state == mj.OK and not first_hour.restart_pending
    assert first_hour.eta_s == pytest.approx((95 - 56) / 6 * 3600, rel=0.05)
    for t, value in samples[721:]:
        wanted = guard.observe(t, int(value), in_flight=1)
        if wanted.trigger:
            break
    assert wanted.trigger == "trend" and wanted.restart_pending and not wanted.restart
    assert 1.3 * 3600 < t < 1.7 * 3600 and wanted.state == mj.OK
    assert "rising 6.0G/h" in wanted.reason and "within the 6 h horizon" in wanted.reason
    taken = guard.observe(t + 5, int(value), in_flight=0)
    assert taken.restart and taken.cause == "memory" and taken.trigger == "trend"


def test_a_cache_that_filled_and_levelled_off_is_no_leak():
    # +24 GiB in the first 20 minutes (an hour-long fit alone would say +24 GiB/h),
    # then flat: the later half of the window says so.
    guard = judge(horizon_s=6 * 3600)
    decision = replay(guard, recording(40, 72, plateau_after_min=20))
    assert decision.state == mj.OK and decision.trigger == "" and decision.eta_s is None


def test_too_few_or_too_short_samples_make_no_trend():
    guard = judge(trend_min_span_s=900)
    assert replay(guard, recording(40, 100, minutes=10)).eta_s is None  # 10 min of samples
    assert mj.trend([(0.0, 1.0)] * 3, 0.0, 10.0) is None


def test_a_shorter_horizon_for_a_slow_leak():
    guard = judge(horizon_s=3600, trend_min_span_s=60, trend_min_samples=5, idle_wait_s=1)
    decision = replay(guard, recording(80, 40, minutes=5), in_flight=0)
    assert decision.trigger == "trend" and decision.restart  # 95 GiB in ~20 min


def test_the_samples_kept_are_the_last_window():
    guard = judge(window_s=3600)
    replay(guard, recording(40, 1, minutes=90, every_s=60))
    kept = guard.samples()
    assert kept[0][0] == 1800 and kept[-1][0] == 5400 and len(kept) == 61
    guard.reset()
    assert guard.samples() == []


def test_the_guard_config_refuses_nonsense():
    with pytest.raises(ValueError):
        mj.MemoryGuardConfig(limit_bytes=0)
    with pytest.raises(ValueError):
        mj.MemoryGuardConfig(limit_bytes=LIMIT, soft_share=0.96, hard_share=0.95)


# -- after a restart: reboot required? ---------------------------------------------------------


def test_wired_memory_that_comes_back():
    watch = mj.WiredWatch(window_s=60)
    watch.server_ended(0, wired_before=60 * GiB, held=40 * GiB)
    assert watch.observe(10, 58 * GiB).state == mj.WAITING
    released = watch.observe(20, 25 * GiB)
    assert released.state == mj.RELEASED and not released.hold_restarts
    assert watch.observe(90, 55 * GiB).state == mj.RELEASED  # a new server wires again


def test_wired_memory_that_stays_wired_says_reboot_required():
    watch = mj.WiredWatch(window_s=60)
    watch.server_ended(0, wired_before=60 * GiB, held=40 * GiB)
    assert watch.observe(59, 59 * GiB).state == mj.WAITING
    verdict = watch.observe(60, 59 * GiB)
    assert verdict.state == mj.REBOOT_REQUIRED and verdict.hold_restarts
    assert verdict.reason.startswith("reboot required: the machine's wired memory (59.0G)")
    assert watch.observe(300, 30 * GiB).state == mj.RELEASED  # it came back after all


def test_too_little_wired_to_tell():
    watch = mj.WiredWatch()
    watch.server_ended(0, wired_before=8 * GiB, held=200 * MiB)
    assert watch.observe(120, 8 * GiB).state == mj.WIRED_UNKNOWN
    watch.server_ended(0, wired_before=None, held=40 * GiB)  # no reading before (Linux)
    assert watch.observe(120, None).state == mj.WIRED_UNKNOWN
