"""Evidence belongs to the instance judged (issue 9, items 2, 7, 16): the
listening socket must be the child's, a heartbeat must come from the judged
process and be newer than its start, and an unusable heartbeat path is said."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from mlx_watchdog.heartbeat import HeartbeatTracker
from mlx_watchdog.judge import BUSY, DOWN, HEALTHY, PORT_TAKEN, Evidence, Judge, JudgeConfig
from mlx_watchdog.listener import ListenerCheck
from mlx_watchdog.probe import OK, UNHEALTHY, ProbeResult
from harness.fakeserver import FakeServer
from tests.test_supervise import wait_for

GOOD = ProbeResult(OK, 0.2, tokens=1, reason="ok", http_status=200)
TIMEOUT = ProbeResult(UNHEALTHY, 1.0, reason="timed out after 1s")


def _beat(path, pid, at):
    path.write_text(json.dumps({"pid": pid, "beats": 5, "time": at, "phase": "serving"}))


# -- the heartbeat (items 2 and 7) ---------------------------------------------


def test_a_heartbeat_from_another_process_is_ignored(tmp_path):
    beat_file = tmp_path / "hb.json"
    _beat(beat_file, os.getppid(), time.time())  # alive, but not the judged process
    tracker = HeartbeatTracker(beat_file, owner=os.getpid)
    assert tracker.sample() is None
    assert "not the server" in tracker.problem


def test_a_heartbeat_older_than_its_process_is_ignored(tmp_path):
    beat_file = tmp_path / "hb.json"
    started = psutil.Process().create_time()
    _beat(beat_file, os.getpid(), started - 3605)  # a full disk kept last hour's file
    tracker = HeartbeatTracker(beat_file, owner=os.getpid)
    assert tracker.sample() is None
    assert "before its process" in tracker.problem


def test_a_heartbeat_from_the_process_or_its_child_counts(tmp_path):
    beat_file = tmp_path / "hb.json"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        for pid in (os.getpid(), child.pid):
            _beat(beat_file, pid, time.time())
            tracker = HeartbeatTracker(beat_file, owner=os.getpid)
            assert tracker.sample() is not None and tracker.problem is None
    finally:
        child.kill()
        child.wait()


def test_the_judge_falls_back_to_cpu_without_a_usable_heartbeat(tmp_path):
    beat_file = tmp_path / "hb.json"
    _beat(beat_file, os.getpid(), psutil.Process().create_time() - 3605)
    beat = HeartbeatTracker(beat_file, owner=os.getpid).sample()
    verdict = Judge(JudgeConfig(failures=3)).observe(
        Evidence(probe=TIMEOUT, now=10.0, process_alive=True, cpu_s=4.0, wall_s=5.0,
                 heartbeat=beat))
    assert verdict.state == BUSY and "CPU" in verdict.reason  # not "heartbeat stale"


# -- an unusable heartbeat path (item 16) -----------------------------------------


@pytest.mark.parametrize("how", ["missing-directory", "a-directory", "a-fifo"])
def test_an_unusable_heartbeat_path_is_named(tmp_path, how):
    if how == "missing-directory":
        path = tmp_path / "nope" / "hb.json"
    else:
        path = tmp_path / "hb.json"
        path.mkdir() if how == "a-directory" else os.mkfifo(path)
    tracker = HeartbeatTracker(path)
    assert tracker.sample() is None  # and a FIFO never blocks the read
    assert str(path) in tracker.problem


def test_the_watchdog_warns_once_about_an_unusable_heartbeat_path(tmp_path):
    from mlx_watchdog.policy import RestartPolicy
    from mlx_watchdog.log import Events
    from mlx_watchdog.monitor import Monitor

    warnings = []

    class Recorder(Events):
        def warning(self, event, message, /, **fields):
            warnings.append((event, message))

    monitor = Monitor("t", lambda: GOOD, judge=Judge(), policy=RestartPolicy(), action=None,
                      heartbeat=HeartbeatTracker(tmp_path / "nope" / "hb.json"),
                      events=Recorder("t"))
    for _ in range(3):
        monitor.tick()
    assert [w for w in warnings if w[0] == "heartbeat"] == [
        ("heartbeat", monitor.heartbeat.problem)]


# -- the listening socket (item 2) -----------------------------------------------


def test_the_judge_calls_a_port_held_by_another_process_down_not_healthy():
    judge = Judge(JudgeConfig(failures=2))
    held = "port 8080 is held by another process (pid 7), not by the server (pid 9)"
    first = judge.observe(Evidence(probe=GOOD, now=1.0, port_held_by=held))
    second = judge.observe(Evidence(probe=GOOD, now=2.0, port_held_by=held))
    assert first.state == DOWN and not first.restart and held in first.reason
    assert second.state == DOWN and second.restart and second.cause == PORT_TAKEN


def test_the_listener_check_names_the_holder():
    with FakeServer() as other:
        headless = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            check = ListenerCheck(other.url, lambda: headless.pid)
            said = check(GOOD)
            assert f"port {other.port} is held by another process" in said
            assert f"pid {os.getpid()}" in said and f"(pid {headless.pid})" in said
            assert ListenerCheck(other.url, os.getpid)(GOOD) is None  # ours: fine
            assert ListenerCheck("http://example.com:80", lambda: headless.pid)(GOOD) is None
        finally:
            headless.kill()
            headless.wait()


def test_a_second_supervise_on_a_taken_port_is_not_fooled(tmp_path):
    state = tmp_path / "state.json"
    log = tmp_path / "supervisor.log"
    with FakeServer() as other:
        command = [
            sys.executable, "-m", "mlx_watchdog.cli", "supervise", "--no-shim",
            "--url", other.url, "--probe-interval", "0.2", "--probe-timeout", "1",
            "--failures", "2", "--boot-grace", "0", "--stop-grace", "1",
            "--state-file", str(state), "--log-format", "json", "--",
            sys.executable, "-c", "import time; time.sleep(300)",
        ]
        with open(log, "w") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            def record():
                try:
                    return next(iter(json.loads(state.read_text())["instances"].values()))
                except (FileNotFoundError, ValueError, StopIteration):
                    return {}
            wait_for(lambda: "held by another process" in record().get("reason", ""), 30,
                     "the taken port to be reported", log)
            assert record()["state"] != HEALTHY
            events = [json.loads(l) for l in log.read_text().splitlines() if l.startswith("{")]
            assert not any(e.get("state") == HEALTHY for e in events)
        finally:
            os.killpg(proc.pid, 15)
            proc.wait(30)
