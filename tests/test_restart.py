"""Planned restarts (`mlx-watchdog restart NAME`) and the held socket, unit
by unit: the monitor's planned_restart and its queue, the control folder
between the command line and a daemon (and who may use it), the drain-first
stop ladder, and supervise's exec trampoline that hands a child fd 3. The
real servers: test_supervise_socket.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from click.testing import CliRunner

from harness.fakes import Clock, FakeAction, FakeProcess
from mlx_watchdog import control, held_socket
from mlx_watchdog.act import ActionResult, SignalRestart, restart_planned
from mlx_watchdog.cli import main
from mlx_watchdog.judge import DOWN, STARTING, Judge, JudgeConfig
from mlx_watchdog.metrics import Metrics
from mlx_watchdog.monitor import PLANNED, Monitor
from mlx_watchdog.policy import RestartPolicy
from mlx_watchdog.probe import OK, ProbeResult
from mlx_watchdog.process import KILLED, TERMINATED, drain_wait_s, stop_draining
from mlx_watchdog.state import StateStore, read_state
from tests.test_supervise import make

GOOD = ProbeResult(OK, 0.2, tokens=1, reason="ok", http_status=200)


class PlannedAction(FakeAction):
    def __init__(self):
        super().__init__()
        self.planned = []

    def restart_planned(self, reason):
        self.planned.append(reason)
        return ActionResult(True, "drained and started again")


def _monitor(tmp_path, action, metrics=None):
    clock = Clock()
    return Monitor("gemma", lambda: GOOD, judge=Judge(JudgeConfig()),
                   policy=RestartPolicy(boot_grace_s=60, backoff_initial_s=1),
                   action=action, process=FakeProcess(), metrics=metrics,
                   state=StateStore(tmp_path / "state.json"), clock=clock, wall_clock=clock)


# -- the monitor ------------------------------------------------------------------------


def test_a_planned_restart_drains_is_counted_apart_and_is_no_backoff(tmp_path):
    action, metrics = PlannedAction(), Metrics()
    monitor = _monitor(tmp_path, action, metrics)
    monitor.started()
    monitor.tick()
    for _ in range(3):
        assert monitor.planned_restart("operator").ok
    assert action.planned == ["operator"] * 3 and action.reasons == []  # no wedge restart
    assert monitor.policy.restarts_in_a_row == 0  # the backoff does not see them
    assert not monitor.policy.crash_looping(monitor.clock())
    assert monitor.policy.in_grace(monitor.clock())  # the new server gets its boot grace
    scrape = metrics.render().decode()
    assert 'mlx_watchdog_restarts_total{cause="none",instance="gemma",reason="planned"} 3.0' in scrape
    monitor.state.flush()
    record = read_state(tmp_path / "state.json")["instances"]["gemma"]
    assert record["restarts"] == 3 and record["last_restart"]["cause"] == PLANNED
    assert record["state"] == STARTING


def test_planned_cause_exists_at_zero_for_rate_queries():
    metrics = Metrics()
    Monitor("m", lambda: GOOD, judge=Judge(JudgeConfig()), policy=RestartPolicy(),
            action=None, metrics=metrics)
    assert 'mlx_watchdog_restarts_total{cause="none",instance="m",reason="planned"} 0.0' in \
        metrics.render().decode()


def test_a_requested_planned_restart_runs_in_the_next_tick_and_wakes_it(tmp_path):
    action = PlannedAction()
    monitor = _monitor(tmp_path, action)
    woken, answers = [], []
    monitor.wake = lambda: woken.append(True)
    monitor.started()
    monitor.request_planned_restart("memory", cause="memory", done=answers.append)
    assert woken and action.planned == []  # asked from another thread: not done there
    monitor.tick()
    assert action.planned == ["memory"] and answers == [ActionResult(True,
                                                                    "drained and started again")]
    assert monitor.record()["last_restart"]["cause"] == "memory"


def test_a_failed_planned_restart_leaves_the_instance_down_without_boot_grace(tmp_path):
    # As any failed restart (a launchctl that is missing): nothing was started.
    action = PlannedAction()
    action.restart_planned = lambda reason: ActionResult(False, "launchctl: command not found")
    monitor = _monitor(tmp_path, action)
    monitor.started()
    monitor.tick()
    result = monitor.planned_restart("operator")
    assert not result.ok
    assert not monitor.policy.in_grace(monitor.clock())
    assert monitor.verdict.state == DOWN
    assert monitor.verdict.reason.startswith("restart failed: launchctl: command not found")
    assert monitor.record()["last_restart"]["ok"] is False


def test_a_watched_only_instance_cannot_be_restarted(tmp_path):
    result = _monitor(tmp_path, None).planned_restart("operator")
    assert not result.ok and "only watched" in result.detail


def test_an_action_without_a_drain_restarts_plainly():
    action = FakeAction()
    assert restart_planned(action, "x").ok and action.reasons == ["x"]


# -- the stop ladder ----------------------------------------------------------------------


def test_stop_draining_waits_for_the_drain_then_stops_as_usual():
    sent, waits = [], []

    def gone_after(n):
        def gone(timeout):
            waits.append(timeout)
            return len(waits) >= n
        return gone

    assert stop_draining(sent.append, gone_after(1), 30, 5) == TERMINATED
    assert sent == [signal.SIGTERM] and waits == [30]
    sent, waits = [], []
    assert stop_draining(sent.append, gone_after(3), 30, 5) == KILLED
    assert sent == [signal.SIGTERM, signal.SIGTERM, signal.SIGKILL] and waits[:2] == [30, 5]


def test_the_drain_wait_follows_the_servers_drain_timeout():
    assert drain_wait_s({}) == 30.0
    assert drain_wait_s({"MLX_HOTFIX_DRAIN_TIMEOUT": "3"}) == 8.0
    assert drain_wait_s({"MLX_HOTFIX_DRAIN_TIMEOUT": "soon"}) == 30.0


def test_supervise_planned_restart_drains_without_stacks(tmp_path, monkeypatch):
    supervisor, spawner, *_ = make(tmp_path)
    supervisor.start()
    first = spawner.current
    calls = []
    first.stop_draining = lambda drain_s, grace_s: calls.append((drain_s, grace_s)) or -15
    monkeypatch.setattr(supervisor, "_capture_stacks", lambda reason: calls.append("stacks"))
    result = supervisor.monitor.planned_restart("operator")
    assert result.ok and calls == [(30.0, 3)], calls
    assert result.detail == "pid 1000 was killed by SIGTERM; started pid 1001"
    assert supervisor.child is spawner.current and spawner.current is not first


SIGTERM_DRAINS = textwrap.dedent("""
    import signal, sys, time
    signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.0), sys.exit(0)))
    print("ready", flush=True)
    while True:
        time.sleep(1)
""")


def test_signal_action_planned_restart_lets_a_drain_finish():
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_DRAINS], stdout=subprocess.PIPE,
                            start_new_session=True)
    try:
        assert proc.stdout.readline() == b"ready\n"
        # A grace far shorter than the drain: only the drain wait lets it finish.
        result = SignalRestart(pid=proc.pid, grace_s=0.1).restart_planned("operator")
        assert result.ok and result.detail == f"sent SIGTERM to pid {proc.pid}; it exited"
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- the trampoline: fd 3 and LISTEN_PID for the server ---------------------------------

SHOW_FD3 = textwrap.dedent("""
    import os, socket
    s = socket.socket(fileno=3)
    print(os.environ["LISTEN_PID"] == str(os.getpid()), os.environ["LISTEN_FDS"],
          s.getsockname()[1], s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
""")


def test_the_trampoline_hands_the_socket_as_fd_3_to_the_exec_ed_program():
    sock = held_socket.bind("127.0.0.1", 0)
    with sock:
        port = sock.getsockname()[1]
        argv = held_socket.command([sys.executable, "-c", SHOW_FD3], sock.fileno(), os.environ)
        done = subprocess.run(argv, pass_fds=(sock.fileno(),), capture_output=True, text=True,
                              timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "1", str(port), "1"]


def test_the_trampoline_refuses_a_program_that_does_not_exist():
    with pytest.raises(FileNotFoundError):
        held_socket.command(["no-such-program-here"], 5, {"PATH": "/usr/bin"})


def test_binding_a_taken_port_is_an_error():
    with held_socket.bind("127.0.0.1", 0) as first:
        with pytest.raises(OSError):
            held_socket.bind("127.0.0.1", first.getsockname()[1])


# -- the control folder --------------------------------------------------------------------


class Recorder:
    def __init__(self):
        self.asked = []

    def request_planned_restart(self, reason, *, cause=PLANNED, done=None):
        self.asked.append(reason)
        done(ActionResult(True, "restarted"))


def test_a_request_is_taken_by_the_daemon_that_runs_the_instance(tmp_path):
    folder = control.control_dir(tmp_path / "state.json")
    mine, theirs = Recorder(), Recorder()
    poller = control.ControlPoller(folder, {"mine": mine})
    other = control.ControlPoller(folder, {"theirs": theirs})
    poller.start()
    other.start()
    try:
        assert oct(os.stat(folder).st_mode & 0o777) == "0o700"
        request = control.Request(folder, "mine", "operator")
        other.poll()  # not its instance: left alone
        assert not request.taken() and theirs.asked == []
        poller.poll()
        assert mine.asked == ["operator"]
        assert request.answer()["detail"] == "restarted"
        assert os.listdir(folder) == []  # nothing left behind
    finally:
        poller.stop()
        other.stop()


def test_a_request_nobody_takes_is_withdrawn_or_dropped_when_stale(tmp_path):
    folder = control.control_dir(tmp_path / "state.json")
    clock = Clock(time.time())
    poller = control.ControlPoller(folder, {"mine": Recorder()}, clock=clock)
    poller.start()
    poller.stop()
    request = control.Request(folder, "nobody", "x")
    poller.poll()
    assert not request.taken()
    clock.now += control.STALE_S + 1
    poller.poll()
    assert request.taken() and not request.withdraw()


def test_only_the_daemons_user_may_ask(tmp_path):
    folder = control.control_dir(tmp_path / "state.json")
    mine = Recorder()
    poller = control.ControlPoller(folder, {"mine": mine})
    poller.start()
    poller.stop()
    # A request file of another user (made here as root, then given away): ignored.
    planted = folder / "restart-0123456789abcdef.request.json"
    planted.write_text(json.dumps({"action": "restart", "instance": "mine"}))
    if os.geteuid() == 0:
        os.chown(planted, 12345, 12345)
        poller.poll()
        assert mine.asked == [] and planted.exists()
    # A link in place of a request file: never followed.
    planted.unlink()
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"action": "restart", "instance": "mine"}))
    planted.symlink_to(target)
    poller.poll()
    assert mine.asked == []


def test_a_control_folder_that_is_a_link_or_someone_elses_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = control.control_dir(tmp_path / "state.json")
    link.symlink_to(real)
    with pytest.raises(control.ControlError, match="not a directory"):
        control.check_folder(link, create=True)
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs.control"
        theirs.mkdir()
        os.chown(theirs, 12345, 12345)
        with pytest.raises(control.ControlError, match="belongs to uid 12345"):
            control.check_folder(theirs, create=True)


# -- the command line ------------------------------------------------------------------------


def _state(tmp_path, instances):
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"version": 1, "instances": instances}))
    return path


def test_restart_names_what_is_wrong(tmp_path, monkeypatch):
    runner = CliRunner()
    missing = runner.invoke(main, ["restart", "x", "--state-file", str(tmp_path / "none.json")])
    assert missing.exit_code == 1 and "no state file at" in missing.output
    path = _state(tmp_path, {"a": {"daemon_pid": os.getpid()}})
    unknown = runner.invoke(main, ["restart", "x", "--state-file", str(path)])
    assert "no instance 'x'" in unknown.output and "instances there: a" in unknown.output
    dead = _state(tmp_path, {"a": {"daemon_pid": 2 ** 22 + 12345}})
    gone = runner.invoke(main, ["restart", "a", "--state-file", str(dead)])
    assert "is not running" in gone.output
    path = _state(tmp_path, {"a": {"daemon_pid": os.getpid()}})
    no_folder = runner.invoke(main, ["restart", "a", "--state-file", str(path)])
    assert "no control folder at" in no_folder.output
    control.check_folder(control.control_dir(path), create=True)  # a folder, but no poller
    monkeypatch.setattr("mlx_watchdog.restart_cli.CLAIM_WAIT_S", 0.5)
    ignored = runner.invoke(main, ["restart", "a", "--state-file", str(path)])
    assert "did not take the request" in ignored.output
    assert os.listdir(control.control_dir(path)) == []  # withdrawn


def test_restart_waits_for_the_answer_and_for_serving_again(tmp_path):
    path = _state(tmp_path, {"a": {"daemon_pid": os.getpid(), "last_ok_probe": 1.0}})
    folder = control.control_dir(path)

    class Serving(Recorder):
        def request_planned_restart(self, reason, *, cause=PLANNED, done=None):
            done(ActionResult(True, "pid 1 was killed by SIGTERM; started pid 2"))
            later = time.time() + 0.5
            path.write_text(json.dumps({"version": 1, "instances": {
                "a": {"daemon_pid": os.getpid(), "last_ok_probe": later}}}))

    poller = control.ControlPoller(folder, {"a": Serving()})
    poller.start()
    try:
        result = CliRunner().invoke(main, ["restart", "a", "--state-file", str(path)])
    finally:
        poller.stop()
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("a: restarting")
    assert lines[1] == "a: restarted: pid 1 was killed by SIGTERM; started pid 2"
    assert lines[2].startswith("a: serving again")


def test_bound_socket_listens_with_a_backlog_of_at_least_128():
    assert held_socket.LISTEN_BACKLOG >= 128
    with held_socket.bind("127.0.0.1", 0) as sock:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1


def test_the_docs_document_the_drain_the_socket_and_restart():
    from pathlib import Path
    import re

    from mlx_watchdog import defaults

    root = Path(__file__).resolve().parents[1]
    reference = (root / "docs" / "reference.md").read_text()
    guide = (root / "docs" / "operator.md").read_text()
    shim_config = (root / "sitecustomize" / "mlx_hotfix" / "config.py").read_text()
    shim_default = float(re.search(r"DEFAULT_DRAIN_TIMEOUT = ([0-9.]+)", shim_config).group(1))
    assert shim_default == defaults.DRAIN_TIMEOUT_S  # the watchdog waits for the shim's drain
    assert f"| `MLX_HOTFIX_DRAIN_TIMEOUT` | `{shim_default:g}` |" in reference
    for name in ("/health/live", '"status": "draining"', "--no-socket", "restart NAME",
                 'reason="planned"', "MLX_HOTFIX_LAUNCHD_SOCKET", "LISTEN_FDS", "`drain`",
                 "`socket`", "Rolling restarts"):
        assert name in guide, name
