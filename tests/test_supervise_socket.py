"""Under `supervise` with the held socket, a client sending one request after
another sees no connection refused and no failed request across three
planned restarts (`mlx-watchdog restart NAME`: the drain, then a new child on
the same socket), and fails only the request in flight at an injected death.
The same client against `supervise --no-socket` is refused while the server
reloads. Real stock servers; no timing assertions.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from harness.haproxy import ClientLoop, Outcome
from harness.procs import chat
from harness.server import VERSIONS, base_env, free_port, python_for
from harness.watchdog_run import WatchdogProcess, wait_serving
from tests.conftest import fault_env

pytestmark = pytest.mark.server

FAST = ["--probe-interval", "1", "--probe-timeout", "30", "--failures", "3",
        "--boot-grace", "120", "--heartbeat-timeout", "10", "--stop-grace", "30"]
LOAD_S = 180
DEATH = "generation thread died"


def server_command(version: str, model: Path, port: int) -> List[str]:
    return [str(python_for(version)), "-m", "mlx_lm", "server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port)]


def failed(outcome: Outcome) -> bool:
    return not outcome.ok and not outcome.refused


@pytest.fixture
def supervisors(tmp_path):
    started: List[WatchdogProcess] = []

    def start(name: str, args: List[str], env: dict) -> WatchdogProcess:
        environment = base_env(shim=False)
        environment.update(env)
        proc = WatchdogProcess(tmp_path, args, name=name, env=environment)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.cleanup()


def planned_restart(sup: WatchdogProcess, name: str) -> str:
    done = subprocess.run([sys.executable, "-m", "mlx_watchdog", "restart", name,
                           "--state-file", str(sup.state_path), "--timeout", str(LOAD_S)],
                          capture_output=True, text=True, timeout=LOAD_S + 30)
    assert done.returncode == 0, done.stdout + done.stderr + sup.tail()
    return done.stdout


def wait_ok_after(loop: ClientLoop, first: int, count: int) -> None:
    """Until `count` requests sent after the first `first` outcomes succeeded."""
    deadline = time.monotonic() + LOAD_S
    while len([o for o in list(loop.outcomes)[first:] if o.ok]) < count:
        assert time.monotonic() < deadline, list(loop.outcomes)[-10:]
        time.sleep(0.1)


def client(url: str) -> ClientLoop:
    # One request after another; each decodes for a while, so a restart
    # catches one in flight. Long timeouts: a request may wait out a reload.
    return ClientLoop(url, workers=1, timeout=LOAD_S, send=lambda: chat(
        url, "tell me a story", max_tokens=40, timeout=LOAD_S))


@pytest.mark.parametrize("version", VERSIONS)
def test_nothing_is_refused_or_failed_across_planned_restarts_with_the_held_socket(
        supervisors, tiny_llama, tmp_path, version):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    arm = tmp_path / "arm"
    env = {**fault_env("raise:typeerror:decode", arm, shim=False),
           "MLX_TEST_FAULT_ONESHOT": "1", "MLX_HOTFIX_REPORT_DIR": str(tmp_path / "reports")}
    sup = supervisors("held", ["supervise", "--name", "held", *FAST, "--",
                               *server_command(version, tiny_llama, port)], env)
    wait_serving(url, LOAD_S, log=sup)
    loop = client(url)
    try:
        loop.wait_count(lambda o: o.ok, 3, LOAD_S)
        for _ in range(3):
            before = len(loop.outcomes)
            output = planned_restart(sup, "held")
            assert "held: serving again" in output, output
            wait_ok_after(loop, before, 2)
        planned_outcomes = list(loop.outcomes)

        arm.touch()  # one death, at the next decode step
        restart = sup.wait_event(lambda e: e["event"] == "restart" and e.get("cause") == "exited",
                                 LOAD_S, "the restart after the death")
        assert restart
        wait_ok_after(loop, len(loop.outcomes), 3)
    finally:
        loop.stop(timeout=LOAD_S)
    outcomes = list(loop.outcomes)
    assert not [o for o in outcomes if o.refused], [o for o in outcomes if o.refused]
    assert not [o for o in planned_outcomes if failed(o)], [o for o in planned_outcomes
                                                           if failed(o)]
    # The death fails the request in flight when it strikes, and only that one.
    death = [o for o in outcomes if failed(o)]
    assert len(death) <= 1, death
    assert all(o.status == 503 for o in death), death
    events = sup.events()
    planned = [e for e in events if e["event"] == "restart" and e.get("cause") == "planned"]
    assert len(planned) == 3, planned
    assert sup.record("held")["restarts"] == 4
    assert sup.terminate() == 0


def test_without_the_held_socket_a_restart_refuses_connections(supervisors, tiny_llama,
                                                              tmp_path):
    """The control: --no-socket, the server binds its own port; while it
    reloads, nothing listens and the same client is refused."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"MLX_HOTFIX_REPORT_DIR": str(tmp_path / "reports")}
    sup = supervisors("bound", ["supervise", "--name", "bound", "--no-socket", *FAST, "--",
                                *server_command("0.32.2", tiny_llama, port)], env)
    wait_serving(url, LOAD_S, log=sup)
    loop = client(url)
    try:
        loop.wait_count(lambda o: o.ok, 3, LOAD_S)
        planned_restart(sup, "bound")
        wait_ok_after(loop, len(loop.outcomes), 2)
    finally:
        loop.stop(timeout=LOAD_S)
    assert [o for o in loop.outcomes if o.refused], loop.outcomes[-20:]
    assert sup.terminate() == 0
