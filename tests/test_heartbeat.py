"""heartbeat: reading the shim's file, whatever state it is in."""

from __future__ import annotations

import json

import pytest

from mlx_watchdog.heartbeat import Heartbeat, HeartbeatTracker, read_heartbeat


def write(path, record) -> None:
    path.write_text(record if isinstance(record, str) else json.dumps(record) + "\n")


def test_reads_a_good_file(tmp_path):
    path = tmp_path / "hb"
    write(path, {"pid": 12, "beats": 340, "time": 1700000000.5, "phase": "serving"})
    assert read_heartbeat(path) == Heartbeat(12, 340, 1700000000.5, "serving")


@pytest.mark.parametrize(
    "content",
    [
        "",
        '{"pid": 12, "beats": 3',  # partial
        "\x00\xff garbage",
        "[1, 2]",
        '{"pid": "12", "beats": 3, "time": 1.0, "phase": "serving"}',
        '{"pid": 12, "beats": true, "time": 1.0, "phase": "serving"}',
        '{"pid": 12, "beats": 3, "time": "now", "phase": "serving"}',
        '{"pid": 12, "beats": 3, "time": 1.0}',
    ],
)
def test_tolerates_partial_and_garbage_files(tmp_path, content):
    path = tmp_path / "hb"
    path.write_text(content, errors="surrogateescape")
    assert read_heartbeat(path) is None


def test_missing_file_or_a_directory(tmp_path):
    assert read_heartbeat(tmp_path / "absent") is None
    assert read_heartbeat(tmp_path) is None


def test_tracker_age_and_progress(tmp_path):
    path = tmp_path / "hb"
    now = [995.0]
    tracker = HeartbeatTracker(path, clock=lambda: now[0], monotonic=lambda: now[0])
    assert tracker.sample() is None
    write(path, {"pid": 1, "beats": 5, "time": 998.0, "phase": "loading"})
    now[0] = 1000.0
    first = tracker.sample()
    assert first.age_s == 2.0 and first.phase == "loading"
    write(path, {"pid": 1, "beats": 9, "time": 1004.5, "phase": "serving"})
    now[0] = 1005.0
    second = tracker.sample()
    assert second.beats == 9 and second.age_s == 0.5
    now[0] = 1035.0  # no new writes: the loop hung
    third = tracker.sample()
    assert third.beats == 9 and third.age_s == 30.5


def test_a_hang_just_after_a_read_is_as_old_as_its_timestamp(tmp_path):
    # Reads every 15 s (a 10 s probe timeout plus the 5 s interval); the loop
    # beat last just after one read, then hung: the next read sees the beats
    # advanced, yet the heartbeat is 10.1 s old, not fresh.
    path = tmp_path / "hb"
    now = [100.0]
    tracker = HeartbeatTracker(path, clock=lambda: now[0], monotonic=lambda: now[0])
    write(path, {"pid": 1, "beats": 50, "time": 99.5, "phase": "serving"})
    tracker.sample()
    write(path, {"pid": 1, "beats": 54, "time": 104.9, "phase": "serving"})
    now[0] = 115.0
    reading = tracker.sample()
    assert reading.beats == 54 and reading.age_s == pytest.approx(10.1)


def test_a_wall_clock_jump_moves_the_age_by_at_most_the_time_between_reads(tmp_path):
    path = tmp_path / "hb"
    wall, mono = [1000.0], [50.0]
    tracker = HeartbeatTracker(path, clock=lambda: wall[0], monotonic=lambda: mono[0])
    write(path, {"pid": 1, "beats": 1, "time": 999.8, "phase": "serving"})
    tracker.sample()
    # The loop beats on; the wall clock jumps 60 s ahead between two reads.
    write(path, {"pid": 1, "beats": 7, "time": 1004.0, "phase": "serving"})
    wall[0], mono[0] = 1065.0, 55.0
    assert tracker.sample().age_s == 5.0  # written since the read 5 s ago
    # The wall clock jumps back an hour while the loop is hung: the beat has
    # been seen unchanged for 30 s, so it is at least that old.
    wall[0], mono[0] = 900.0, 85.0
    assert tracker.sample().age_s == 30.0


def test_tracker_new_pid_is_progress_and_reset_forgets(tmp_path):
    path = tmp_path / "hb"
    now = [10.0]
    tracker = HeartbeatTracker(path, clock=lambda: 10.0, monotonic=lambda: now[0])
    write(path, {"pid": 1, "beats": 5, "time": 9.0, "phase": "serving"})
    tracker.sample()
    now[0] = 30.0  # the same beat, seen unchanged for 20 s
    assert tracker.sample().age_s == 20.0
    now[0] = 35.0
    write(path, {"pid": 2, "beats": 5, "time": 9.0, "phase": "serving"})
    assert tracker.sample().age_s == 1.0  # another process: its beat is new
    now[0] = 50.0
    assert tracker.sample().age_s == 15.0
    tracker.reset()
    assert tracker.sample().age_s == 1.0  # forgotten: as if first seen now


def test_clock_skew_never_gives_a_negative_age(tmp_path):
    path = tmp_path / "hb"
    write(path, {"pid": 1, "beats": 5, "time": 50.0, "phase": "serving"})
    assert HeartbeatTracker(path, clock=lambda: 10.0).sample().age_s == 0.0


def test_the_shims_warning_is_read_as_one_printable_line(tmp_path):
    path = tmp_path / "hb"
    record = {"pid": 12, "beats": 3, "time": 1.0, "phase": "serving",
              "warning": "mlx-lm 0.31.0 was yanked\n\x1b[2J"}
    write(path, record)
    assert read_heartbeat(path).warning == "mlx-lm 0.31.0 was yanked \\x1b[2J"
    tracker = HeartbeatTracker(path, clock=lambda: 2.0, monotonic=lambda: 5.0)
    assert tracker.sample().warning == "mlx-lm 0.31.0 was yanked \\x1b[2J"
    write(path, dict(record, warning=["not", "text"]))
    assert read_heartbeat(path).warning is None
