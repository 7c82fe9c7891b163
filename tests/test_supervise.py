"""supervise: Supervisor.tick with fakes, then a real supervisor process with a
tiny fake server as its child (harness/fakeserver.py)."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import psutil
import pytest

from harness import FAKE_SERVER
from harness.fakes import Clock, FakeProcess
from mlx_watchdog import defaults
from mlx_watchdog.policy import RestartPolicy
from mlx_watchdog.config import InstanceConfig, RestartConfig
from mlx_watchdog.judge import (
    BUSY,
    CRASH_LOOPING,
    DOWN,
    EXITED,
    HEALTHY,
    HEARTBEAT_STALE,
    STARTING,
    WEDGED,
)
from mlx_watchdog.metrics import Metrics
from mlx_watchdog.probe import OK, UNHEALTHY, ProbeResult
from mlx_watchdog.supervise import (
    Supervisor,
    SupervisorError,
    describe_exit,
    url_from_command,
)

GOOD = ProbeResult(OK, 0.2, tokens=1, reason="ok", http_status=200)
TIMEOUT = ProbeResult(UNHEALTHY, 1.0, reason="timed out after 1s")
REPO = Path(__file__).resolve().parents[1]


# -- url_from_command ------------------------------------------------------------


@pytest.mark.parametrize(
    "command, url",
    [
        (["mlx_lm.server", "--model", "m"], "http://127.0.0.1:8080"),
        (["mlx_lm.server", "--port", "9000"], "http://127.0.0.1:9000"),
        (["python", "-m", "mlx_lm", "server", "--port=9001", "--host=localhost"],
         "http://localhost:9001"),
        (["mlx_lm.server", "--host", "0.0.0.0", "--port", "81"], "http://127.0.0.1:81"),
        (["mlx_lm.server", "--host", "::"], "http://[::1]:8080"),
        (["mlx_lm.server", "--host", "fe80::1"], "http://[fe80::1]:8080"),
    ],
)
def test_url_from_command(command, url):
    assert url_from_command(command) == url


def test_url_from_command_rejects_a_bad_port():
    with pytest.raises(ValueError):
        url_from_command(["mlx_lm.server", "--port", "http"])


def test_describe_exit():
    assert "generation thread" in describe_exit(defaults.SHIM_EXIT_CODE)
    assert describe_exit(defaults.SHIM_EXIT_CODE, shim=False) == "exited with code 70"
    assert describe_exit(-9) == "was killed by SIGKILL"
    assert describe_exit(1) == "exited with code 1"


# -- tick() with fakes ------------------------------------------------------------


class FakeChild:
    def __init__(self, pid: int):
        self.pid = pid
        self.code = None
        self.stops: List[tuple] = []
        self.signals: List[int] = []

    def poll(self):
        return self.code

    def stop(self, grace_s, sig=signal.SIGTERM):
        self.stops.append((grace_s, sig))
        if self.code is None:
            self.code = -signal.SIGTERM
        return self.code

    def signal_group(self, sig):
        self.signals.append(sig)

    def end_group(self, grace_s):
        self.signals.append("end-group")


class FakeSpawner:
    def __init__(self):
        self.children: List[FakeChild] = []
        self.envs: List[dict] = []
        self.argvs: List[list] = []
        self.fail = None

    def __call__(self, argv, env):
        if self.fail is not None:
            raise self.fail
        child = FakeChild(1000 + len(self.children))
        self.children.append(child)
        self.argvs.append(argv)
        self.envs.append(dict(env))
        return child

    @property
    def current(self) -> FakeChild:
        return self.children[-1]


class Probes:
    def __init__(self, clock):
        self.clock = clock
        self.next = GOOD

    def __call__(self):
        self.clock.now += 5
        return self.next


def make(tmp_path, *, boot_grace=0.0, max_restarts=5, backoff=1.0):
    clock = Clock(100.0)
    spawner = FakeSpawner()
    probes = Probes(clock)
    process = FakeProcess()
    supervisor = Supervisor(
        ["mlx_lm.server", "--port", "8080"],
        InstanceConfig("test", "http://127.0.0.1:8080", RestartConfig("none"), failures=2,
                       stop_grace=3, report_dir=str(tmp_path / "reports")),
        probe=probes,
        env={"PATH": "/usr/bin"},
        heartbeat_file=tmp_path / "heartbeat.json",
        policy=RestartPolicy(boot_grace_s=boot_grace, backoff_initial_s=backoff,
                             max_restarts=max_restarts, window_s=300),
        spawn=spawner,
        process=process,
        metrics=Metrics(),
        clock=clock,
        wall_clock=clock,
    )
    return supervisor, spawner, probes, process, clock


def test_start_spawns_the_command_with_the_heartbeat_file(tmp_path):
    supervisor, spawner, *_ = make(tmp_path)
    (tmp_path / "heartbeat.json").write_text("left over from a previous child")
    supervisor.start()
    assert spawner.argvs == [["mlx_lm.server", "--port", "8080"]]
    assert spawner.envs[0][defaults.HEARTBEAT_ENV] == str(tmp_path / "heartbeat.json")
    assert spawner.envs[0]["PATH"] == "/usr/bin"
    assert not (tmp_path / "heartbeat.json").exists()
    assert supervisor.monitor.verdict.state == STARTING


def test_a_command_that_cannot_run_fails_the_start(tmp_path):
    supervisor, spawner, *_ = make(tmp_path)
    spawner.fail = FileNotFoundError(2, "No such file or directory")
    with pytest.raises(SupervisorError, match="cannot run 'mlx_lm.server': No such file"):
        supervisor.start()


def test_child_exit_is_restarted_at_once(tmp_path):
    supervisor, spawner, *_ = make(tmp_path)
    supervisor.start()
    assert supervisor.tick().state == HEALTHY
    spawner.current.code = 70
    verdict = supervisor.tick()
    assert verdict.cause == EXITED and "generation thread" in verdict.reason
    assert len(spawner.children) == 2 and supervisor.child is spawner.current
    assert supervisor.monitor.restarts == 1


def test_repeated_exits_back_off_and_a_crash_loop_never_stops_restarts(tmp_path):
    supervisor, spawner, probes, _, clock = make(tmp_path, max_restarts=2, backoff=1.0)
    supervisor.monitor.policy.backoff_max_s = 8.0
    supervisor.start()
    spawner.current.code = 1
    assert supervisor.tick().state == DOWN  # restarted at once
    assert len(spawner.children) == 2
    states = set()
    for _ in range(60):  # 60 deaths, each seen 0.5 s after the last restart
        spawner.current.code = 1
        clock.now += 0.5
        exit_seen = clock.now
        before = len(spawner.children)
        while len(spawner.children) == before:
            states.add(supervisor.tick().state)
            assert clock.now - exit_seen <= 8.0  # never longer than the cap
            clock.now += 0.25
    assert CRASH_LOOPING in states
    assert len(spawner.children) == 62


def test_a_tick_that_raises_is_logged_and_supervising_goes_on(tmp_path, caplog):
    supervisor, spawner, probes, _, clock = make(tmp_path)
    supervisor.interval_s = 0.01
    calls = []
    real_tick = supervisor.tick

    def tick():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug in one tick")
        if len(calls) >= 3:
            supervisor.request_stop()
        return real_tick()

    supervisor.tick = tick
    with caplog.at_level("ERROR"):
        assert supervisor.run() == 0
    assert len(calls) >= 3
    failed = [r for r in caplog.records if getattr(r, "event", "") == "tick-error"]
    assert failed and failed[0].exc_info and "a bug in one tick" in str(failed[0].exc_info[1])
    assert spawner.children[0].stops or spawner.children[0].signals  # the child was stopped


def test_the_child_goes_when_the_loop_itself_breaks(tmp_path):
    supervisor, spawner, *_ = make(tmp_path)
    supervisor.interval_s = 0.01

    def broken_sleep(_):
        raise KeyboardInterrupt  # not an Exception: the loop ends

    supervisor._wakeup.sleep = broken_sleep
    with pytest.raises(KeyboardInterrupt):
        supervisor.run()
    child = spawner.children[0]
    assert child.stops and signal.SIGKILL in child.signals or child.code is not None
    assert supervisor.child is None


def test_a_wedged_child_gets_sigusr1_for_its_stacks_before_sigterm(tmp_path, monkeypatch):
    supervisor, spawner, probes, process, clock = make(tmp_path)
    supervisor.stacks_wait_s = 0.01
    order = []
    monkeypatch.setattr(
        "mlx_watchdog.reports.capture_stacks",
        lambda pids, **kw: order.append(("stacks", list(pids), kw["reason"])) or None)
    supervisor.start()
    child = spawner.current
    real_stop = child.stop
    child.stop = lambda grace_s, sig=signal.SIGTERM: order.append(("stop", grace_s)) or real_stop(
        grace_s, sig)
    supervisor.restart("wedged: no progress")
    assert order[0][0] == "stacks" and order[0][1][0] == child.pid
    assert order[1] == ("stop", 3)


def test_backoff_waits_between_restarts(tmp_path):
    supervisor, spawner, probes, _, clock = make(tmp_path, backoff=60.0)
    supervisor.start()
    spawner.current.code = 1
    supervisor.tick()
    spawner.current.code = 1
    clock.now += 5
    verdict = supervisor.tick()
    assert verdict.state == DOWN and "backoff" in verdict.reason
    assert len(spawner.children) == 2
    clock.now += 60
    supervisor.tick()
    assert len(spawner.children) == 3


def test_wedged_child_is_stopped_and_replaced(tmp_path):
    supervisor, spawner, probes, process, _ = make(tmp_path)
    supervisor.start()
    first = spawner.current
    supervisor.tick()
    probes.next = TIMEOUT  # and the CPU is idle
    verdicts = [supervisor.tick().state for _ in range(2)]
    assert verdicts[-1] == WEDGED
    assert first.stops == [(3, signal.SIGTERM)]
    assert len(spawner.children) == 2


def test_busy_child_is_left_alone(tmp_path):
    supervisor, spawner, probes, process, _ = make(tmp_path)
    supervisor.start()
    probes.next, process.cpu_s = TIMEOUT, 2.5
    assert {supervisor.tick().state for _ in range(50)} == {BUSY}
    assert len(spawner.children) == 1 and spawner.current.stops == []


def test_stale_heartbeat_wins_over_busy_cpu(tmp_path):
    supervisor, spawner, probes, process, _ = make(tmp_path)
    supervisor.start()
    heartbeat = {"pid": 1000, "beats": 10, "time": time.time() - 100, "phase": "serving"}
    (tmp_path / "heartbeat.json").write_text(json.dumps(heartbeat))
    probes.next, process.cpu_s = TIMEOUT, 2.5
    verdict = supervisor.tick()  # one failed probe is enough with a stale heartbeat
    assert verdict.state == WEDGED and verdict.cause == HEARTBEAT_STALE
    assert len(spawner.children) == 2


def test_boot_grace_protects_a_slow_start(tmp_path):
    supervisor, spawner, probes, process, _ = make(tmp_path, boot_grace=60)
    supervisor.start()
    probes.next = TIMEOUT
    assert {supervisor.tick().state for _ in range(11)} == {STARTING}  # 55 s
    assert len(spawner.children) == 1


def test_stop_forwards_the_signal_at_once_and_never_respawns(tmp_path):
    supervisor, spawner, *_ = make(tmp_path)
    supervisor.start()
    child = spawner.current
    supervisor.request_stop(signal.SIGINT)
    assert child.signals == [signal.SIGINT]
    child.code = -signal.SIGINT
    assert "shutting down" in supervisor.tick().reason
    assert len(spawner.children) == 1
    assert not supervisor.restart("wedged").ok
    supervisor.child = child
    supervisor.shutdown()
    assert child.stops == [(3, None)]  # not signalled twice; SIGKILL after the grace


# -- a real supervisor process -------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition, timeout: float, what: str, log: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}; supervisor log:\n{log.read_text()[-4000:]}")


class RealSupervisor:
    def __init__(self, tmp_path: Path, first_start: str):
        self.starts = tmp_path / "starts"
        self.state = tmp_path / "state.json"
        self.log = tmp_path / "supervisor.log"
        port = free_port()
        command = [
            sys.executable, "-m", "mlx_watchdog.cli", "supervise", "--no-shim",
            "--probe-interval", "0.2", "--probe-timeout", "1", "--failures", "2",
            "--boot-grace", "20", "--stop-grace", "3", "--state-file", str(self.state),
            "--log-format", "json", "--",
            sys.executable, str(FAKE_SERVER), "--port", str(port), "--starts", str(self.starts),
            "--first-start", first_start,
        ]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def child_pids(self) -> List[int]:
        try:
            return [int(line) for line in self.starts.read_text().split()]
        except FileNotFoundError:
            return []

    def record(self) -> dict:
        try:
            return json.loads(self.state.read_text())["instances"][next(iter(
                json.loads(self.state.read_text())["instances"]))]
        except (FileNotFoundError, ValueError, StopIteration):
            return {}

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.child_pids():
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass


@pytest.fixture
def real_supervisor(tmp_path):
    started = []

    def start(first_start: str) -> RealSupervisor:
        supervisor = RealSupervisor(tmp_path, first_start)
        started.append(supervisor)
        return supervisor

    yield start
    for supervisor in started:
        supervisor.cleanup()


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_real_child_that_exits_is_restarted(real_supervisor):
    sup = real_supervisor("exit")
    wait_for(lambda: len(sup.child_pids()) >= 2, 30, "a second start", sup.log)
    wait_for(lambda: sup.record().get("restarts", 0) >= 1, 10, "the restart recorded", sup.log)
    assert sup.record()["last_restart"]["cause"] == EXITED
    assert "code 70" in sup.log.read_text()
    wait_for(lambda: sup.record().get("state") == HEALTHY, 30, "healthy again", sup.log)
    assert sup.terminate() == 0


def test_real_child_that_hangs_is_restarted(real_supervisor):
    sup = real_supervisor("hang")
    wait_for(lambda: len(sup.child_pids()) >= 2, 30, "a second start", sup.log)
    first = sup.child_pids()[0]
    wait_for(lambda: gone(first), 10, "the hung child to be gone", sup.log)
    wait_for(lambda: sup.record().get("restarts", 0) >= 1, 10, "the restart recorded", sup.log)
    assert sup.record()["last_restart"]["cause"] in ("no-progress", "busy-too-long")
    assert sup.terminate() == 0


def test_sigterm_stops_the_child_and_exits_0(real_supervisor):
    sup = real_supervisor("ok")
    wait_for(lambda: sup.record().get("state") == HEALTHY, 30, "a healthy child", sup.log)
    [child] = sup.child_pids()
    assert sup.terminate() == 0
    wait_for(lambda: gone(child), 10, "the child to be gone", sup.log)
    events = [json.loads(line)["event"] for line in sup.log.read_text().splitlines()
              if line.startswith("{")]
    assert "stopping" in events and "stopped" in events


# -- the CLI's own checks -------------------------------------------------------------


@pytest.fixture(autouse=True)
def _restore_logging():
    # supervise points the log at CliRunner's stream, closed after the test.
    yield
    from mlx_watchdog.log import setup_logging

    setup_logging("text")


def test_cli_needs_a_port_it_can_read():
    from click.testing import CliRunner

    from mlx_watchdog.cli import main

    result = CliRunner().invoke(main, ["supervise", "--", "mlx_lm.server", "--port", "http"])
    assert result.exit_code == 2 and "pass --url" in result.output


def test_cli_without_the_shim_says_how_to_go_on(monkeypatch):
    from click.testing import CliRunner

    from mlx_watchdog import shim
    from mlx_watchdog.cli import main

    def missing(env=None):
        raise FileNotFoundError("mlx-watchdog: the hotfix drop-in folder is missing")

    monkeypatch.setattr(shim, "with_shim", missing)
    result = CliRunner().invoke(main, ["supervise", "--", "mlx_lm.server"])
    assert result.exit_code == 1 and "--no-shim" in result.output


def test_cli_command_not_found(tmp_path):
    from click.testing import CliRunner

    from mlx_watchdog.cli import main

    result = CliRunner().invoke(
        main,
        ["supervise", "--no-shim", "--state-file", str(tmp_path / "s.json"),
         "--url", "http://127.0.0.1:8080", "--", str(tmp_path / "no-such-server")],
    )
    assert result.exit_code == 1 and "cannot run" in result.output


# -- stopping from a signal handler ----------------------------------------------------


def test_wakeup_is_cut_short_by_a_signal_handler():
    from mlx_watchdog.wakeup import Wakeup

    wakeup = Wakeup()
    previous = signal.signal(signal.SIGALRM, lambda *_: wakeup.wake())
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        started = time.monotonic()
        wakeup.sleep(30)
        assert time.monotonic() - started < 20
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        wakeup.close()
    wakeup.wake()  # closed: ignored, never raises
    wakeup.sleep(0)


def test_request_stop_from_a_storm_of_signals_never_deadlocks(tmp_path):
    # The old Event-based stop could deadlock when a signal landed while the
    # main thread held the Event's lock. Hammer the loop's sleep with signals.
    supervisor, spawner, *_ = make(tmp_path)
    supervisor.start()
    previous = signal.signal(signal.SIGALRM, lambda signum, _: supervisor.request_stop(signum))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)
        for _ in range(300):
            supervisor._wakeup.sleep(0.001)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert supervisor._stopping
    assert spawner.current.signals == [signal.SIGALRM]  # forwarded once


def test_cli_builds_its_monitor_from_the_same_options_as_watch(tmp_path, monkeypatch):
    # --cpu-busy and --health reach the judge and the probe, as cpu_busy and
    # health_check do in a watch config (both go through compose.build_monitor).
    from click.testing import CliRunner

    from mlx_watchdog.cli import main

    built = []
    monkeypatch.setattr(Supervisor, "run", lambda self: built.append(self.monitor) or 0)
    result = CliRunner().invoke(
        main,
        ["supervise", "--no-shim", "--state-file", str(tmp_path / "s.json"), "--cpu-busy", "0.5",
         "--health", "--failures", "4", "--", "mlx_lm.server", "--port", "8123"],
    )
    assert result.exit_code == 0, result.output
    [monitor] = built
    assert monitor.judge.config.cpu_busy_fraction == 0.5 and monitor.judge.config.failures == 4
    assert monitor.probe.check_health and monitor.url == "http://127.0.0.1:8123"
    assert "--cpu-busy" in CliRunner().invoke(main, ["supervise", "--help"]).output


def test_the_listener_check_is_on_by_default_and_can_be_turned_off(tmp_path, monkeypatch):
    # On: a probe counts only when the child holds the port (issue 9). Off: for
    # a port held by something the child does not own (a container's proxy).
    from click.testing import CliRunner

    from mlx_watchdog.cli import main

    built = []
    monkeypatch.setattr(Supervisor, "run", lambda self: built.append(self.monitor) or 0)
    base = ["supervise", "--no-shim", "--state-file", str(tmp_path / "s.json")]
    command = ["--", "mlx_lm.server", "--port", "8123"]
    for flags in ([], ["--no-listener-check"]):
        result = CliRunner().invoke(main, base + flags + command)
        assert result.exit_code == 0, result.output
    on, off = built
    assert on.listener is not None and off.listener is None


def test_a_tick_that_keeps_raising_is_said_once_and_its_recovery_too(tmp_path, caplog):
    supervisor, spawner, probes, _, clock = make(tmp_path)
    supervisor.interval_s = 0.01
    calls = []
    real_tick = supervisor.tick

    def tick():
        calls.append(1)
        if len(calls) >= 6:
            supervisor.request_stop()
        if len(calls) <= 4:
            raise RuntimeError("the same bug at every tick")
        return real_tick()

    supervisor.tick = tick
    with caplog.at_level("INFO"):
        assert supervisor.run() == 0
    said = [r for r in caplog.records if getattr(r, "event", "") == "tick-error"]
    assert [bool(r.exc_info) for r in said] == [True, False]  # the failure, the recovery
    assert "recovered after: RuntimeError: the same bug" in said[1].getMessage()


@pytest.mark.parametrize("how", ["the child exits", "the child stops answering"])
def test_a_normal_stop_is_no_failure(tmp_path, caplog, how):
    # SIGTERM arrives while a tick is under way: the child's exit (or its
    # silence while it drains) is what was asked for; it is not restarted,
    # and nothing says "restart-failed" at ERROR, nor warns.
    supervisor, spawner, probes, _, clock = make(tmp_path)
    supervisor.start()
    assert supervisor.tick().state == HEALTHY
    caplog.clear()  # only what is said once the stop is asked for
    supervisor.request_stop()
    if how == "the child exits":
        spawner.current.code = 0
    else:
        probes.next = TIMEOUT
    with caplog.at_level("INFO"):
        for _ in range(3):
            supervisor.monitor.tick()
    loud = [(r.levelname, getattr(r, "event", ""), r.getMessage()) for r in caplog.records
            if r.levelno >= logging.WARNING]
    assert loud == []
    assert len(spawner.children) == 1 and supervisor.monitor.restarts == 0
