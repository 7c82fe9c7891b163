"""Throughput counters from the heartbeat, crash reports, and their metrics (unit tests)."""

from __future__ import annotations

import json
import os

from prometheus_client.parser import text_string_to_metric_families

from mlx_watchdog.heartbeat import read_record
from mlx_watchdog.metrics import Metrics
from mlx_watchdog.report_watcher import ReportWatcher
from mlx_watchdog.throughput import CounterTotals, ThroughputTracker


def _samples(metrics: Metrics) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }


def test_totals_take_the_first_reading_as_baseline_then_add_increments():
    totals = CounterTotals()
    assert totals.update(10, {"decode_tokens": 500}) == {}
    assert totals.update(10, {"decode_tokens": 530}) == {"decode_tokens": 30}
    assert totals.update(10, {"decode_tokens": 530}) == {}
    assert totals.totals["decode_tokens"] == 30


def test_totals_survive_a_server_restart():
    totals = CounterTotals()
    totals.update(10, {"decode_tokens": 100, "requests": 4})
    totals.update(10, {"decode_tokens": 150, "requests": 5})
    # A new process (new pid) counts from zero: all it counted is new.
    assert totals.update(11, {"decode_tokens": 20, "requests": 1}) == {
        "decode_tokens": 20, "requests": 1}
    # ...even when its count is above the old process's last value.
    totals.update(12, {"decode_tokens": 400})
    assert totals.totals["decode_tokens"] == 50 + 20 + 400
    # The same pid going backwards (a reset) is also counted from zero.
    totals.update(12, {"decode_tokens": 7})
    assert totals.totals["decode_tokens"] == 477
    assert totals.totals["requests"] == 2


def test_tracker_reads_counters_and_rates_and_tolerates_old_shims(tmp_path):
    path = tmp_path / "hb"
    now = [100.0]
    tracker = ThroughputTracker(clock=lambda: now[0])

    def sample():
        return tracker.observe(read_record(path))

    assert sample() is None  # no file yet
    path.write_text(json.dumps({"pid": 1, "beats": 3, "time": 1.0, "phase": "serving"}))
    reading = sample()
    assert reading.in_flight is None and reading.rates["decode_tokens"] is None
    record = {"pid": 1, "beats": 4, "time": 2.0, "phase": "serving", "in_flight": 2,
              "prompt_tokens": 1000, "decode_tokens": 50, "requests": 3, "cancelled": 1}
    path.write_text(json.dumps(record))
    now[0] += 10
    sample()
    now[0] += 10
    path.write_text(json.dumps(dict(record, decode_tokens=250, prompt_tokens=1100)))
    reading = sample()
    assert reading.in_flight == 2
    assert reading.increments == {"decode_tokens": 200, "prefill_tokens": 100}
    assert reading.rates["decode_tokens"] == 200 / 20  # over all 20 s it watched
    path.write_text("{garbage")
    assert sample() is None


def test_reports_counts_only_new_report_files(tmp_path):
    from mlx_watchdog import contract

    old, a, b = (contract.report_name("died", pid, 1_700_000_000 + pid) for pid in (1, 2, 3))
    folder = tmp_path / "reports"
    watcher = ReportWatcher(folder)
    assert watcher.scan().new == 0  # no folder yet
    folder.mkdir()
    (folder / old).write_text("{}")
    scan = watcher.scan()
    assert scan.new == 1 and scan.newest == old  # appeared after we started
    (folder / a).write_text("{}")
    (folder / b).write_text("{}")
    os.utime(folder / a, (2e9, 2e9))
    (folder / "notes.txt").write_text("")
    (folder / "notes.json").write_text("{}")  # not a report name: not ours
    scan = watcher.scan()
    assert scan.new == 2 and scan.newest == a
    assert watcher.scan().new == 0
    (folder / a).unlink()
    assert watcher.scan().new == 0


def test_reports_already_there_at_start_are_not_new(tmp_path):
    from mlx_watchdog import contract

    old = contract.report_name("died", 1, 1_700_000_000)
    (tmp_path / old).write_text("{}")
    watcher = ReportWatcher(tmp_path)
    assert watcher.scan().new == 0
    assert watcher.newest[1] == old


def test_metrics_export_throughput_and_reports(tmp_path):
    metrics = Metrics()
    metrics.add_instance("a", ("dead-thread",))
    samples = _samples(metrics)
    assert samples[("mlx_watchdog_decode_tokens_total", (("instance", "a"),))] == 0
    assert samples[("mlx_watchdog_restarts_total",
                    (("cause", "none"), ("instance", "a"), ("reason", "dead-thread")))] == 0
    path = tmp_path / "hb"
    tracker = ThroughputTracker()
    for pid, decoded in ((5, 10), (5, 30), (6, 4)):
        path.write_text(json.dumps({"pid": pid, "decode_tokens": decoded, "in_flight": 1}))
        metrics.observe_throughput("a", tracker.observe(read_record(path)))
    metrics.reports_written("a", 2)
    samples = _samples(metrics)
    assert samples[("mlx_watchdog_decode_tokens_total", (("instance", "a"),))] == 24
    assert samples[("mlx_watchdog_in_flight", (("instance", "a"),))] == 1
    assert samples[("mlx_watchdog_crash_reports_total", (("instance", "a"),))] == 2


def test_admission_counts_become_gauges_and_monotonic_labelled_counters():
    # The shim's admission part: queued/running gauges, refusals by reason and
    # deadline stops as counters that only grow, across a server restart too.
    tracker = ThroughputTracker()
    metrics = Metrics()
    metrics.add_instance("gemma")
    record = {"pid": 1, "beats": 1, "time": 1.0, "phase": "serving", "in_flight": 1,
              "queued": 2, "running": 1, "rejected_queue_full": 5, "rejected_queue_timeout": 1,
              "deadline_stops": 0}
    steps = [record,
             dict(record, rejected_queue_full=22, rejected_queue_timeout=3, deadline_stops=2),
             # A new process: its counts start again from zero, and all of them are new.
             dict(record, pid=2, queued=0, running=0, rejected_queue_full=4,
                  rejected_queue_timeout=0, deadline_stops=1)]
    for step in steps:
        reading = tracker.observe(step)  # one record per tick, as the monitor reads it
        metrics.observe_throughput("gemma", reading)
    assert (reading.queued, reading.running) == (0, 0)
    samples = _samples(metrics)
    instance = (("instance", "gemma"),)
    assert samples[("mlx_watchdog_queued", instance)] == 0
    assert samples[("mlx_watchdog_running", instance)] == 0
    full = (("instance", "gemma"), ("reason", "queue_full"))
    timed_out = (("instance", "gemma"), ("reason", "queue_timeout"))
    # The first reading is the baseline (5 and 1), then 17 + 4 and 2 + 0.
    assert samples[("mlx_watchdog_rejected_total", full)] == 21
    assert samples[("mlx_watchdog_rejected_total", timed_out)] == 2
    assert samples[("mlx_watchdog_deadline_stops_total", instance)] == 3
    assert not any(name.startswith("mlx_watchdog_rejected_queue") for name, _ in samples)


def test_admission_counters_are_zero_before_the_first_refusal():
    metrics = Metrics()
    metrics.add_instance("gemma")
    samples = _samples(metrics)
    for reason in ("queue_full", "queue_timeout"):
        assert samples[("mlx_watchdog_rejected_total",
                        (("instance", "gemma"), ("reason", reason)))] == 0
    assert samples[("mlx_watchdog_deadline_stops_total", (("instance", "gemma"),))] == 0
