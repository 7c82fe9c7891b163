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


def test_a_probe_answered_by_another_process_is_no_ok_probe(tmp_path):
    # The answer came from whoever holds the port, not from our server: no
    # "last ok probe", mlx_watchdog_up 0, and the backoff is not reset by it.
    from mlx_watchdog import compose
    from mlx_watchdog.config import InstanceConfig, RestartConfig
    from mlx_watchdog.metrics import Metrics

    with FakeServer() as other:
        headless = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            instance = InstanceConfig(name="a", url=other.url, restart=RestartConfig("none"),
                                      timeout=5, report_dir=str(tmp_path / "reports"))
            metrics = Metrics()
            monitor = compose.build_monitor(instance, action=None, metrics=metrics,
                                            listener=ListenerCheck(other.url,
                                                                   lambda: headless.pid))
            for _ in range(3):
                monitor.policy.record_restart(monitor.clock())
            verdict = monitor.tick()
            record = monitor.record()
            assert verdict.state == DOWN and "held by another process" in verdict.reason
            assert record["last_ok_probe"] is None
            assert record["last_probe"]["status"] != "ok"
            assert "another process" in record["last_probe"]["reason"]
            assert 'mlx_watchdog_up{instance="a"} 0.0' in metrics.render().decode()
            assert monitor.policy.restarts_in_a_row == 3
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


# -- StacksFirst signals only the server's own processes (issue 18) ----------------

def _server_like(reports_dir, env=None):
    """A real process that dumps its stacks on SIGUSR1 into
    reports_dir/stacks-<its pid>.txt, as the shim arms a server."""
    code = (
        "import faulthandler, os, signal, time\n"
        f"path = os.path.join({str(reports_dir)!r}, 'stacks-%d.txt' % os.getpid())\n"
        "faulthandler.register(signal.SIGUSR1, file=open(path, 'a'), all_threads=True)\n"
        "open(path + '.armed', 'w').close()\n"
        "time.sleep(120)\n"
    )
    reports_dir.mkdir(exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    armed = reports_dir / f"stacks-{proc.pid}.txt.armed"
    wait_for(armed.exists, 60, "the SIGUSR1 handler", armed)
    return proc


def _victim(reports_dir):
    """Another user's process, say: no SIGUSR1 handler (the signal kills it),
    and a stacks file planted in its name."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    (reports_dir / f"stacks-{proc.pid}.txt").write_text("")
    return proc


@pytest.mark.parametrize("with_locator", [True, False])
def test_stacks_first_signals_the_heartbeats_pid_only_when_it_is_the_servers(
        tmp_path, with_locator):
    from mlx_watchdog import defaults
    from mlx_watchdog.config import InstanceConfig, RestartConfig
    from mlx_watchdog.process import ProcessLocator
    from mlx_watchdog.watch import StacksFirst
    from harness.fakes import FakeAction

    reports_dir, beat_file = tmp_path / "reports", tmp_path / "hb.json"
    env = {**os.environ, defaults.HEARTBEAT_ENV: str(beat_file)}
    server = _server_like(reports_dir, env=env)
    victim = _victim(reports_dir)
    try:
        instance = InstanceConfig(name="a", url="http://127.0.0.1:9",
                                  restart=RestartConfig("none"), heartbeat_file=str(beat_file),
                                  report_dir=str(reports_dir))
        locator = ProcessLocator(pid=server.pid) if with_locator else None
        stacks_first = StacksFirst(FakeAction(), instance, locator)
        _beat(beat_file, victim.pid, time.time())  # written by the server's user
        stacks_first.restart("wedged")
        assert victim.poll() is None, "SIGUSR1 killed a process that is not the server's"
        assert "not" in stacks_first.refused
        report = json.loads(open(stacks_first.last_report).read())
        assert report["stacks_refused"] == stacks_first.refused
        _beat(beat_file, server.pid, time.time())  # the server's own beat: its stacks
        stacks_first.restart("wedged")
        assert stacks_first.refused is None
        report = json.loads(open(stacks_first.last_report).read())
        assert report["stacks_from"] == [server.pid] and "thread" in report["stacks_text"]
    finally:
        for proc in (server, victim):
            proc.kill()
            proc.wait()
