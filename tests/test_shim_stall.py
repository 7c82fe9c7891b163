"""Liveness from delivered tokens, on the real stock servers (shim, no watchdog).

A livelock (upstream #1493: the loop turns, ``BatchGenerator.next`` returns
nothing, forever) keeps the loop's pulse going; only deliveries tell. The
shim's /health must say so, its heartbeat must say "stalled", and systemd's
WATCHDOG=1 pings must stop. A loading server is not ready; an idle one and a
long healthy decode are fine. Stock says 200 in every one of these cases.
"""

from __future__ import annotations

import json
import time

import pytest
import requests

from tests.conftest import fault_env
from harness.server import VERSIONS, BackgroundRequest
from tests.test_sdnotify_server import FakeSystemd

pytestmark = pytest.mark.server

STALL_S = 3  # short, for speed: the tiny model's single steps take milliseconds


def health(server, path="/health"):
    response = requests.get(f"{server.url}{path}", timeout=10)
    return response.status_code, response.json()


def live(server):
    """/health/live: liveness, apart from /health's readiness."""
    return health(server, "/health/live")


def read(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def wait_for_log(server, text, timeout=60):
    wait_for(lambda: text in server.log(), timeout, f"{text!r} in the server log\n{server.log()}")


@pytest.mark.parametrize("version", VERSIONS)
def test_health_is_ok_idle_and_decoding_and_503_stalled_in_a_livelock(
        servers, tiny_llama, tmp_path, version):
    arm, beat_file = tmp_path / "arm", tmp_path / "heartbeat.json"
    env = fault_env("livelock:batch", arm)
    env.update({"MLX_HOTFIX_STALL_TIMEOUT": str(STALL_S),
                "MLX_HOTFIX_HEARTBEAT_FILE": str(beat_file),
                "MLX_HOTFIX_HEARTBEAT_INTERVAL": "0.2"})
    server = servers(version, tiny_llama, env=env)
    server.warm_up()

    time.sleep(STALL_S + 1)  # idle for longer than the stall timeout: nobody waits
    status, body = health(server)
    assert (status, body["status"], body["in_flight"]) == (200, "ok", 0), body
    assert live(server) == (200, {"status": "alive", "phase": "serving"})

    # A long healthy decode, longer than the stall timeout: 200 all through.
    answers = []
    decode = BackgroundRequest(lambda: server.chat("a long one", max_tokens=4000, timeout=300))
    while not decode.join(0.3):
        answers.append(health(server))
    assert decode.status == 200 and decode.json()["usage"]["completion_tokens"] == 4000, decode
    assert answers and all(a[0] == 200 and a[1]["status"] == "ok" for a in answers), answers
    assert any(a[1]["in_flight"] >= 1 for a in answers), answers
    wait_for(lambda: read(beat_file)["decode_tokens"] >= 4000, 30, "the tokens counted")

    arm.touch()
    BackgroundRequest(lambda: server.chat("this one livelocks", max_tokens=50, timeout=120))
    wait_for_log(server, "mlx-test-fault: livelock at batch")
    status, body = wait_for(lambda: (lambda a: a if a[0] == 503 else None)(health(server)),
                            STALL_S + 30, "/health to say 503")
    assert body["status"] == "stalled" and body["in_flight"] >= 1, body
    status, body = live(server)  # stalled: not worth keeping, whatever the loop does
    assert status == 503 and body["status"] == "stalled", body
    beat = wait_for(lambda: (lambda b: b if b and b["phase"] == "stalled" else None)(
        read(beat_file)), 30, "the heartbeat to say stalled")
    assert beat["in_flight"] >= 1 and beat["pid"] == server.proc.pid
    first = beat["beats"]
    wait_for(lambda: read(beat_file)["beats"] > first, 30, "the loop to go on turning")
    assert server.alive()


def test_health_says_loading_until_the_model_is_loaded(servers, tiny_llama, tmp_path):
    # The model load hangs: stock 0.32.2 says 200 here (0.31.3 too).
    env = fault_env("hang:load")
    server = servers("0.32.2", tiny_llama, env=env)
    server.wait_listening()
    wait_for_log(server, "mlx-test-fault: hang at load")
    status, body = health(server)
    assert (status, body["status"]) == (503, "loading") and set(body) == {"status", "memory"}
    # Not ready, but alive: a liveness probe must not kill a loading server.
    assert live(server) == (200, {"status": "alive", "phase": "loading"})


@pytest.mark.parametrize("version", VERSIONS)
def test_liveness_says_503_once_the_generation_thread_is_dead(servers, tiny_llama, tmp_path,
                                                            version):
    # The exit part off, so that the dead server stays up to be asked.
    arm = tmp_path / "arm"
    env = dict(fault_env("raise:typeerror:decode", arm), MLX_HOTFIX_DISABLE="exit")
    server = servers(version, tiny_llama, env=env)
    server.warm_up()
    assert live(server)[0] == 200
    arm.touch()
    BackgroundRequest(lambda: server.chat("this one dies", max_tokens=20, timeout=10))
    wait_for_log(server, "mlx-test-fault: raise at decode")
    status, body = wait_for(lambda: (lambda a: a if a[0] == 503 else None)(live(server)), 30,
                            "/health/live to say 503")
    assert body["status"] == "unavailable", body
    assert server.alive()


@pytest.mark.parametrize("version", VERSIONS)
def test_ready_and_pings_with_exit_disabled_and_pings_stop_when_stalled(
        servers, tiny_llama, tmp_path, version):
    fake = FakeSystemd(tmp_path / "notify.sock")
    try:
        arm = tmp_path / "arm"
        env = fault_env("livelock:batch", arm)
        env.update({"NOTIFY_SOCKET": fake.path, "WATCHDOG_USEC": "1000000",
                    "MLX_HOTFIX_DISABLE": "exit", "MLX_HOTFIX_STALL_TIMEOUT": str(STALL_S)})
        server = servers(version, tiny_llama, env=env)
        assert fake.wait_for("READY=1"), (fake.texts(), server.log())
        server.warm_up()
        assert "exit disabled" in server.log()

        idle_from = time.monotonic()
        time.sleep(3)
        assert fake.pings(idle_from) >= 2, fake.texts(idle_from)

        arm.touch()
        BackgroundRequest(lambda: server.chat("this one livelocks", max_tokens=50, timeout=120))
        wait_for(lambda: any(t.startswith("STATUS=stalled") for t in fake.texts()),
                 STALL_S + 30, f"STATUS=stalled\n{fake.texts()}\n{server.log()}")
        time.sleep(1)  # a ping already in flight
        stalled_from = time.monotonic()
        time.sleep(3)
        assert fake.pings(stalled_from) == 0, fake.texts(stalled_from)
        assert server.alive()
    finally:
        fake.close()


STALL_ORDER = """
import sys, threading
sys.path.insert(0, sys.argv[1])
from mlx_hotfix import heartbeat

announced = []
heartbeat._announce = lambda stalled, now: announced.append(stalled)
heartbeat._loop_running, heartbeat._in_flight = True, 1
start = 1000.0
heartbeat._progress_mono, heartbeat._beat_mono = start, start + 10**6  # only deliveries decide
limit = heartbeat.config.current().stall_timeout
# The keeper decides at a fresh reading; a /health handler read the clock just
# before and asks now; then the loop, later still.
heartbeat._check_stall(start + limit + 1)
heartbeat._check_stall(start + limit - 1)
heartbeat._check_stall(start + limit + 2)
# Many threads at once, around the moment of a stall and of its end.
for round in range(50):
    base = start + (round + 1) * 10 * limit
    stalled = round % 2 == 1
    heartbeat._progress_mono = base - 2 * limit if stalled else base
    gate = threading.Barrier(4)
    def ask(offset):
        gate.wait()
        for i in range(20):
            heartbeat._check_stall(base + offset + i / 100)
    threads = [threading.Thread(target=ask, args=(k / 10,)) for k in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
print(announced[:1], len(announced))
"""


def test_a_stall_is_decided_once_whoever_asks_first(envs):
    # Three threads ask (the loop, the keeper, /health handlers), each with its
    # own clock reading: a stale reading must not end a stall it did not see end.
    from harness.server import SHIM_DIR, run_python

    done = run_python(VERSIONS[-1], STALL_ORDER, shim=False, args=[str(SHIM_DIR)])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[True] 51"  # the first stall, then one per change
