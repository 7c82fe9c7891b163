"""Monitor.tick with fakes; the state file, status, metrics, logs; Watcher."""

from __future__ import annotations

import io
import json
import logging
import re
import threading

import click
import pytest
from click.testing import CliRunner

from harness.fakes import Clock, FakeAction, FakeProcess

from mlx_watchdog.policy import RestartPolicy
from mlx_watchdog.cli import main
from mlx_watchdog.judge import (
    BUSY,
    CRASH_LOOPING,
    FAILING,
    HEALTHY,
    NO_PROGRESS,
    STARTING,
    WEDGED,
    Judge,
    JudgeConfig,
)
from mlx_watchdog.log import Events, setup_logging
from mlx_watchdog.metrics import Metrics
from mlx_watchdog.monitor import Monitor
from mlx_watchdog.probe import OK, UNHEALTHY, ProbeResult
from mlx_watchdog.state import StateStore, read_state
from mlx_watchdog.status_view import format_status
from mlx_watchdog.watch import Watcher

GOOD = ProbeResult(OK, 0.2, tokens=1, reason="ok", http_status=200)
TIMEOUT = ProbeResult(UNHEALTHY, 10.0, reason="timed out after 10s")


@pytest.fixture
def logs():
    stream = io.StringIO()
    setup_logging("json", stream, level=logging.DEBUG)
    yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    setup_logging("text")


def make_monitor(tmp_path, probes, *, cpu=0.0, action=None, boot_grace=0.0, failures=2,
                 clock=None):
    clock = clock or Clock()
    feed = iter(probes)

    def probe():
        clock.now += 5
        return next(feed)

    monitor = Monitor(
        "gemma",
        probe,
        judge=Judge(JudgeConfig(failures=failures)),
        policy=RestartPolicy(boot_grace_s=boot_grace, backoff_initial_s=0),
        action=action,
        url="http://user:pw@127.0.0.1:8080",
        process=FakeProcess(cpu),
        metrics=Metrics(),
        state=StateStore(tmp_path / "state.json"),
        clock=clock,
        wall_clock=clock,
    )
    return monitor


def test_healthy_tick_reports_everywhere(tmp_path, logs):
    monitor = make_monitor(tmp_path, [GOOD])
    monitor.started()
    verdict = monitor.tick()
    assert verdict.state == HEALTHY
    record = read_state(tmp_path / "state.json")["instances"]["gemma"]
    assert record["state"] == HEALTHY and record["restarts"] == 0
    assert record["url"] == "http://user:***@127.0.0.1:8080"
    assert record["last_probe"]["status"] == "ok" and record["last_probe"]["latency_s"] == 0.2
    metrics = monitor.metrics.render().decode()
    assert 'mlx_watchdog_up{instance="gemma"} 1.0' in metrics
    assert 'mlx_watchdog_state{instance="gemma",state="healthy"} 1.0' in metrics
    assert 'mlx_watchdog_state{instance="gemma",state="crash-looping"} 0.0' in metrics
    assert 'mlx_watchdog_probe_latency_seconds_count{instance="gemma"} 1.0' in metrics
    events = [(e["event"], e["instance"]) for e in logs()]
    assert events == [("state", "gemma"), ("state", "gemma")]  # starting, healthy


def test_wedge_restarts_once_and_starts_afresh(tmp_path, logs):
    action = FakeAction()
    monitor = make_monitor(tmp_path, [GOOD, TIMEOUT, TIMEOUT, TIMEOUT], action=action,
                           boot_grace=30)
    monitor.policy.started(monitor.clock())
    states = [monitor.tick().state for _ in range(3)]
    assert states == [HEALTHY, FAILING, WEDGED]
    assert len(action.reasons) == 1 and "CPU idle" in action.reasons[0]
    assert monitor.process.resets == 1
    # Boot grace after the restart: the next failure does not count.
    assert monitor.tick().state == STARTING
    record = read_state(tmp_path / "state.json")["instances"]["gemma"]
    assert record["restarts"] == 1
    assert record["last_restart"]["cause"] == NO_PROGRESS and record["last_restart"]["ok"]
    metrics = monitor.metrics.render().decode()
    assert 'mlx_watchdog_restarts_total{cause="none",instance="gemma",reason="no-progress"} 1.0' in metrics
    restart_logs = [e for e in logs() if e["event"] in ("restart", "restarted")]
    assert [e["level"] for e in restart_logs] == ["warning", "info"]
    assert restart_logs[0]["cause"] == NO_PROGRESS


def test_busy_server_is_left_alone(tmp_path):
    action = FakeAction()
    monitor = make_monitor(tmp_path, [TIMEOUT] * 30, cpu=2.0, action=action)
    assert {monitor.tick().state for _ in range(30)} == {BUSY}
    assert action.reasons == []


def test_failing_action_keeps_being_retried_and_shows_a_crash_loop(tmp_path, logs):
    action = FakeAction(ok=False)
    monitor = make_monitor(tmp_path, [TIMEOUT] * 40, action=action, failures=1)
    verdicts = [monitor.tick() for _ in range(40)]
    assert len(action.reasons) == 40  # crash-looping never stops the restarts
    assert verdicts[-1].state == CRASH_LOOPING and verdicts[-1].restart
    assert "crash-looping" in verdicts[-1].reason or verdicts[-1].state == CRASH_LOOPING
    assert "restart failed: launchctl: command not found" in verdicts[0].reason
    assert any(e["event"] == "restart-failed" for e in logs())
    record = read_state(tmp_path / "state.json")["instances"]["gemma"]
    assert record["state"] == CRASH_LOOPING and record["last_restart"]["ok"] is False


def test_monitor_only_never_restarts(tmp_path):
    monitor = make_monitor(tmp_path, [TIMEOUT] * 3, action=None)
    verdicts = [monitor.tick() for _ in range(3)]
    assert verdicts[-1].state == WEDGED and not verdicts[-1].restart
    assert "monitor only" in verdicts[-1].reason and monitor.restarts == 0


def test_state_changes_are_logged_once(tmp_path, logs):
    monitor = make_monitor(tmp_path, [GOOD] * 5)
    for _ in range(5):
        monitor.tick()
    assert len([e for e in logs() if e["event"] == "state"]) == 1


def test_an_unwritable_state_file_is_a_warning_not_a_crash(tmp_path, logs):
    (tmp_path / "blocker").write_text("a file where a folder should be")
    monitor = make_monitor(tmp_path, [GOOD, GOOD])
    monitor.state = StateStore(tmp_path / "blocker" / "state.json")
    monitor.tick()
    monitor.tick()
    warnings = [e for e in logs() if e["event"] == "state-file"]
    assert len(warnings) == 1 and "cannot write state file" in warnings[0]["message"]


# -- the state file and `status` -------------------------------------------------


def test_state_file_keeps_other_daemons_instances(tmp_path):
    path = tmp_path / "state.json"
    other = {"state": "healthy", "daemon_pid": 999999999, "url": "http://x"}
    path.write_text(json.dumps({"version": 1, "instances": {"other": other}}))
    store = StateStore(path)
    store.update("mine", {"state": "busy"})
    instances = read_state(path)["instances"]
    assert set(instances) == {"other", "mine"}
    assert not list(tmp_path.glob(".state.json.*"))  # no temporary left behind


def test_format_status():
    data = {
        "instances": {
            "gemma": {
                "state": "wedged", "reason": "timed out; CPU idle", "since": 900.0,
                "url": "http://127.0.0.1:8080",
                "last_probe": {"status": "unhealthy", "latency_s": 10.0, "reason": "timed out",
                               "time": 995.0},
                "restarts": 2,
                "last_restart": {"time": 400.0, "cause": "no-progress", "ok": True,
                                 "detail": "ran launchctl"},
                "daemon_pid": 4242, "updated": 995.0,
            }
        }
    }
    text = format_status(data, now=1000.0, pid_alive=lambda pid: True)
    assert "gemma: wedged for 1m40s  http://127.0.0.1:8080" in text
    assert "last probe: unhealthy in 10.00s, 5s ago (timed out)" in text
    assert "restarts: 2, last 10m00s ago (no-progress, ok: ran launchctl)" in text
    # Its watchdog gone: the row no longer claims a state anyone is watching.
    text = format_status(data, now=1000.0, pid_alive=lambda pid: False)
    assert re.search(r"^gemma +stale \(watchdog not running\) 5s ", text, re.M), text
    assert "pid 4242) is not running; last update 5s ago, when it said wedged" in text
    assert "status --prune" in text


def test_status_reads_stale_and_stopped_records():
    from mlx_watchdog.state import STALE, STOPPED, shown_state

    record = {"state": "healthy", "updated": 1000.0, "interval_s": 15.0}
    assert shown_state(record, 1040.0, running=True) == "healthy"
    assert shown_state(record, 1046.0, running=True) == STALE  # three intervals silent
    assert shown_state(record, 1001.0, running=False) == STALE  # its writer is gone
    assert shown_state(dict(record, state=STOPPED), 9999.0, running=False) == STOPPED


def test_a_stopped_or_stale_row_shows_no_live_counts():
    """The decode rate and request counts of a server no one watches now are
    not current: a stopped or stale row shows none."""
    server = {"decode_tok_s": 34.7, "running": 7, "queued": 0}
    record = {"state": "healthy", "since": 900.0, "updated": 990.0, "interval_s": 5.0,
              "restarts": 0, "server": server, "daemon_pid": 1}
    live = format_status({"instances": {"a": record}}, now=1000.0, pid_alive=lambda pid: True)
    assert "34.7 tok/s, 7 running" in live
    # Stopped (by its writer); then healthy, but its writer gone.
    for shown, alive in ((dict(record, state="stopped"), True), (record, False)):
        text = format_status({"instances": {"a": shown}}, now=1000.0,
                             pid_alive=lambda pid, alive=alive: alive)
        assert "tok/s" not in text and "7 running" not in text, text


def test_format_status_is_a_fleet_table():
    data = {
        "instances": {
            "mac1": {
                "state": "healthy", "since": 400.0, "restarts": 1,
                "last_probe": {"status": "ok", "latency_s": 0.2, "time": 998.0},
                "last_ok_probe": 998.0,
                "last_restart": {"time": 700.0, "cause": "heartbeat-stale", "ok": True},
                "server": {"decode_tok_s": 56.04, "in_flight": 2, "phase": "serving"},
                "newest_report": {"file": "/r/crash-1.json", "time": 640.0},
                "daemon_pid": 1,
            },
            "mac2": {
                "state": "crash-looping", "reason": "exited 70; 6 restarts in 300s: crash loop",
                "since": 940.0, "restarts": 6, "url": "http://mac2:8080",
                "last_probe": {"status": "unreachable", "latency_s": 0.0, "time": 990.0,
                               "reason": "connection refused"},
                "last_ok_probe": None,
                "last_restart": {"time": 950.0, "cause": "exited", "ok": False, "detail": "x"},
                "daemon_pid": 1,
            },
            "mac3": "garbage",
            "mac4": {
                "state": "busy", "since": 990.0, "restarts": 0, "last_ok_probe": 999.0,
                # The admission part's counts replace the in-flight figure.
                "server": {"decode_tok_s": 12.0, "in_flight": 1, "running": 1, "queued": 2},
                "daemon_pid": 1,
            },
        }
    }
    text = format_status(data, now=1000.0, pid_alive=lambda pid: True)
    lines = text.splitlines()
    assert lines[0].split() == ["INSTANCE", "STATE", "LAST", "OK", "PROBE", "RESTARTS", "DECODE",
                                "NEWEST", "REPORT"]
    row = {line.split()[0]: line for line in lines[1:5]}
    assert re.search(r"healthy 10m00s +2s ago +1 \(heartbeat-stale 5m00s ago\) +"
                     r"56\.0 tok/s, 2 in flight +crash-1\.json 6m00s ago", row["mac1"])
    assert re.search(r"crash-looping 1m00s +never +6 \(exited 50s ago, FAILED\) +- +-", row["mac2"])
    assert re.search(r"mac3 +malformed record \(not a table\)", row["mac3"])
    assert re.search(r"busy 10s +1s ago +0 +12\.0 tok/s, 1 running, 2 queued", row["mac4"])
    # The details follow for the instance that is not well, and only for it.
    assert "mac2: crash-looping for 1m00s  http://mac2:8080" in text
    assert "why: exited 70; 6 restarts in 300s: crash loop" in text
    assert "mac1:" not in text
    coloured = format_status(data, now=1000.0, pid_alive=lambda pid: True, colour=True)
    assert "\x1b[" in coloured and click.unstyle(coloured) == text


def test_status_cli(tmp_path):
    path = tmp_path / "state.json"
    missing = CliRunner().invoke(main, ["status", "--state-file", str(path)])
    assert missing.exit_code == 1 and "no state file at" in missing.output
    StateStore(path).update("gemma", {"state": "healthy", "since": 0, "restarts": 0})
    text = CliRunner().invoke(main, ["status", "--state-file", str(path)])
    assert text.exit_code == 0 and re.search(r"^gemma +healthy ", text.output, re.M), text.output
    assert "\x1b[" not in text.output  # no colour when not on a terminal
    as_json = CliRunner().invoke(main, ["status", "--json", "--state-file", str(path)])
    assert json.loads(as_json.output)["instances"]["gemma"]["state"] == "healthy"
    path.write_text("not json")
    broken = CliRunner().invoke(main, ["status", "--state-file", str(path)])
    assert broken.exit_code == 1 and "cannot read" in broken.output


def test_status_default_path_follows_xdg(tmp_path):
    result = CliRunner().invoke(main, ["status"], env={"XDG_STATE_HOME": str(tmp_path)})
    assert result.exit_code == 1
    assert str(tmp_path / "mlx-watchdog" / "state.json") in result.output


# -- logs ----------------------------------------------------------------------------


def test_json_log_lines(logs):
    Events("gemma").warning("restart", "restarting: wedged", cause="no-progress", level="x")
    [line] = logs()
    assert line["event"] == "restart" and line["instance"] == "gemma"
    assert line["level"] == "warning" and line["message"] == "restarting: wedged"
    assert line["cause"] == "no-progress" and line["field_level"] == "x"
    assert "T" in line["time"]


def test_text_log_lines():
    stream = io.StringIO()
    setup_logging("text", stream)
    try:
        Events("gemma").info("restarted", "ran launchctl", pid=12)
    finally:
        setup_logging("text")
    assert "INFO    [gemma] restarted: ran launchctl pid=12" in stream.getvalue()


def test_text_log_lines_are_one_line_each_with_control_characters_escaped():
    stream = io.StringIO()
    setup_logging("text", stream)
    try:
        Events("a\nINFO forged").warning("state", "wedged: \x1b[2Jboom\nline two", code=1)
    finally:
        setup_logging("text")
    text = stream.getvalue()
    assert text.count("\n") == 1 and "\x1b" not in text
    assert "[a\\x0aINFO forged] state: wedged: \\x1b[2Jboom\\x0aline two code=1" in text


# -- Watcher ---------------------------------------------------------------------------


def test_watcher_ticks_every_monitor_until_stopped():
    ticked = {"a": threading.Event(), "b": threading.Event()}

    class Ticking:
        state = None

        def __init__(self, name):
            self.name = name
            self.events = Events(name)

        def started(self):
            pass

        def tick(self):
            ticked[self.name].set()
            if self.name == "b":
                raise RuntimeError("a bug in one monitor")

    watcher = Watcher({n: Ticking(n) for n in ticked}, {"a": 0.01, "b": 0.01})
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(watcher.run()))
    thread.start()
    try:
        assert all(event.wait(10) for event in ticked.values())
    finally:
        watcher.request_stop()
        thread.join(10)
    assert outcome == [0]


def test_state_store_writes_changes_at_once_and_the_rest_at_most_every_interval(tmp_path):
    path = tmp_path / "state.json"
    store = StateStore(path, min_interval_s=3600)
    store.update("a", {"state": "healthy", "n": 1})
    store.update("a", {"state": "healthy", "n": 2})  # same state, too soon
    assert read_state(path)["instances"]["a"]["n"] == 1
    store.update("a", {"state": "busy", "n": 3})  # a change: written at once
    assert read_state(path)["instances"]["a"]["n"] == 3
    store.update("a", {"state": "busy", "n": 4})
    store.flush()
    assert read_state(path)["instances"]["a"]["n"] == 4


def test_metrics_server(tmp_path):
    import urllib.request

    from tests.test_supervise import free_port

    metrics = Metrics()
    metrics.observe("gemma", GOOD, HEALTHY)
    port = free_port()
    server = metrics.serve(port)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            text = answer.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert 'mlx_watchdog_up{instance="gemma"} 1.0' in text


def test_watch_command_runs_until_sigterm(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from harness.fakeserver import FakeServer

    state = tmp_path / "state.json"
    with FakeServer() as server:
        config = tmp_path / "watch.toml"
        config.write_text(
            f'[instances.gemma]\nurl = "{server.url}"\ninterval = 0.2\n'
            f'restart = {{ type = "none" }}\n'
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_watchdog.cli", "watch", "--config", str(config),
             "--state-file", str(state), "--log-format", "json"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    if read_state(state)["instances"]["gemma"]["state"] == HEALTHY:
                        break
                except (OSError, ValueError, KeyError):
                    pass
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            output, _ = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, output
    # A clean stop says so: `status` must not show a healthy instance nobody watches.
    record = read_state(state)["instances"]["gemma"]
    assert record["state"] == "stopped" and "watchdog stopped" in record["reason"], record
    assert '"event": "watch"' in output


# -- the boot grace ends when the heartbeat says serving ---------------------------


class FakeHeartbeat:
    def __init__(self, reading=None):
        self.reading = reading
        self.resets = 0

    def observe(self, record):
        return self.reading

    def reset(self):
        self.resets += 1


def _reading(phase, started, age=0.5):
    from mlx_watchdog.heartbeat import HeartbeatReading

    return HeartbeatReading(age_s=age, phase=phase, beats=5, pid=7,
                            started=started)


def _booting_monitor(tmp_path, reading, probes):
    monitor = make_monitor(tmp_path, probes, action=FakeAction(), boot_grace=600)
    monitor.heartbeat = FakeHeartbeat(reading)
    monitor.started()
    return monitor


def test_a_serving_heartbeat_of_the_new_process_ends_the_boot_grace(tmp_path, logs):
    clock_at_start = 1000.0
    monitor = _booting_monitor(tmp_path, _reading("serving", clock_at_start + 1, age=30),
                               [TIMEOUT, TIMEOUT])
    verdict = monitor.tick()
    # Out of the grace at once: a stale heartbeat is judged, not waited out.
    assert verdict.state == WEDGED and monitor.restarts == 1
    assert monitor.record()["last_restart"]["cause"] == "heartbeat-stale"
    assert "loaded" in [e["event"] for e in logs()]


@pytest.mark.parametrize("reading", [
    None,  # no heartbeat at all
    ("loading", 1001.0),  # still loading
    ("serving", 900.0),  # the previous process's file
    ("serving", None),  # an older shim: no "started"
])
def test_the_boot_grace_holds_without_the_new_process_serving(tmp_path, reading):
    beat = _reading(*reading, age=30) if reading else None
    monitor = _booting_monitor(tmp_path, beat, [TIMEOUT, TIMEOUT])
    assert [monitor.tick().state for _ in range(2)] == [STARTING, STARTING]
    assert monitor.restarts == 0


# -- a known-bad install, said by the shim (issue 12) -------------------------

BAD_PAIR = "mlx-lm 0.31.0 with mlx 0.32.4: dies on the first request; fix: pip install 'mlx<0.32'"


def test_the_shims_warning_reaches_the_state_file_and_status(tmp_path, logs):
    from mlx_watchdog.heartbeat import HeartbeatReading

    warned = ProbeResult(OK, 0.2, tokens=1, reason="ok", http_status=200, warning=BAD_PAIR)
    monitor = make_monitor(tmp_path, [warned, GOOD, GOOD])
    monitor.started()
    monitor.tick()  # no heartbeat: the probe's /health says it
    monitor.tick()  # a probe without /health keeps it
    record = read_state(tmp_path / "state.json")["instances"]["gemma"]
    assert record["state"] == HEALTHY and record["warning"] == BAD_PAIR
    assert [e["message"] for e in logs() if e["event"] == "install"] == [BAD_PAIR]  # once
    # The heartbeat decides when there is one: it outlives the death that follows.
    monitor.heartbeat = FakeHeartbeat(HeartbeatReading(
        age_s=0.5, phase="serving", beats=5, pid=7, started=1001.0))
    monitor.tick()
    assert monitor.record()["warning"] is None

    data = {"instances": {"gemma": dict(record, daemon_pid=1)}}
    text = format_status(data, now=1000.0, pid_alive=lambda pid: True)
    assert f"  WARNING: {BAD_PAIR}" in text.splitlines()  # shown although healthy
    del data["instances"]["gemma"]["warning"]
    assert "WARNING" not in format_status(data, now=1000.0, pid_alive=lambda pid: True)


# -- a start that served ends the backoff (issue 18) ---------------------------


@pytest.mark.parametrize("started, delivered, served", [
    (1001.0, 12, True),  # the new server delivered between probes
    (1001.0, 0, False),  # loaded, nothing delivered yet
    (900.0, 12, False),  # the previous process's file
])
def test_a_new_server_whose_heartbeat_delivered_ends_the_backoff(tmp_path, started,
                                                                 delivered, served):
    from mlx_watchdog.heartbeat import HeartbeatReading

    monitor = make_monitor(tmp_path, [TIMEOUT], action=FakeAction())
    monitor.started()
    for _ in range(3):  # three starts that never served
        monitor.policy.record_restart(monitor.clock())
    monitor.heartbeat = FakeHeartbeat(HeartbeatReading(
        age_s=0.5, phase="serving", beats=5, pid=7, started=started, delivered=delivered))
    assert monitor.tick().state == BUSY  # the probe failed, the loop beats
    assert monitor.policy.restarts_in_a_row == (0 if served else 3)


def test_a_watch_thread_survives_a_failing_start_and_says_each_failure_once(logs):
    # monitor.started() raising used to end the thread, unnoticed: the
    # instance was never watched again. Every failure is said once.
    ticks = threading.Event()

    class Failing:
        state = None

        def __init__(self):
            self.name = "a"
            self.events = Events("a")
            self.starts = self.calls = 0

        def started(self):
            self.starts += 1
            if self.starts == 1:
                raise RuntimeError("the state file is broken")

        def tick(self):
            self.calls += 1
            if self.calls >= 5:
                ticks.set()
            raise ValueError("a bug in every tick")

    monitor = Failing()
    watcher = Watcher({"a": monitor}, {"a": 0.01})
    thread = threading.Thread(target=watcher.run)
    thread.start()
    try:
        assert ticks.wait(30), "the monitor thread died"
    finally:
        watcher.request_stop()
        thread.join(10)
    errors = [e for e in logs() if e["event"] == "error"]
    assert [e["exception"].splitlines()[-1] for e in errors] == [
        "RuntimeError: the state file is broken", "ValueError: a bug in every tick"]


def test_probes_piling_up_on_the_server_are_said_once_per_run(tmp_path, logs):
    abandoned = ProbeResult(UNHEALTHY, 10.0, reason="timed out after 10s", abandoned=True)
    monitor = make_monitor(tmp_path, [abandoned, abandoned, abandoned, GOOD, abandoned,
                                      abandoned], cpu=2.0, failures=100)
    for _ in range(6):
        monitor.tick()
    said = [e["message"] for e in logs() if e["event"] == "probe"]
    assert len(said) == 2  # the second abandoned probe of each run
    assert "may still be in flight on the server" in said[0]


def test_a_long_start_says_how_it_goes_every_30s(tmp_path, logs):
    # Each probe moves the clock 5 s; a minute and a half of boot grace.
    monitor = make_monitor(tmp_path, [TIMEOUT] * 19, boot_grace=600)
    monitor.started()
    for _ in range(19):
        assert monitor.tick().state == "starting"
    progress = [e["message"] for e in logs() if e["event"] == "loading"]
    assert progress == [f"still starting after {s}s: timed out after 10s" for s in (30, 60, 90)]


def test_text_log_lines_say_each_thing_once():
    stream = io.StringIO()
    setup_logging("text", stream)
    from mlx_watchdog.log import Events

    events = Events("qwen")
    events.info("spawned", "started pid 20864", pid=20864)
    events.warning("exited", "server exited with code 70", returncode=70)
    events.warning("restart", "restarting: server exited", state="down", cause="exited",
                   restarts_in_a_row=0)
    setup_logging("text")
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith("[qwen] spawned: started pid 20864")
    assert lines[1].endswith("exited: server exited with code 70")
    assert lines[2].endswith('restart: restarting: server exited state="down" restarts_in_a_row=0')
