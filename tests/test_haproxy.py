"""monitoring/haproxy.cfg in a real HAProxy, in front of two servers.

A backend that dies, livelocks or is still loading its model stops getting
traffic once HAProxy's check on /health says so, and no client request sent
after that check interval fails: the healthy server takes it all.

The real-server cases run the stock mlx_lm.server of each tested release with
the hotfix shim, whose /health tells the truth (503 "stalled" / "loading").
The same behaviour is also shown against a small stand-in server that
answers /health as the shim does.
"""

from __future__ import annotations

import re
import time

import pytest

from tests.conftest import fault_env
from harness.fakeserver import HANG, HEALTH_OK, FakeServer, json_answer
from harness.haproxy import CONFIG, ClientLoop, HAProxy, config_for, haproxy_binary
from harness.server import VERSIONS

_TIMING = re.search(r"inter (\d+)s fall (\d+)", CONFIG.read_text())
# How long HAProxy may take to mark a server down: `fall` checks `inter` apart.
CHECK_INTERVAL_S = int(_TIMING.group(1)) * int(_TIMING.group(2))

HEALTH_STALLED = json_answer(503, {"status": "stalled"})
HEALTH_LOADING = json_answer(503, {"status": "loading"})


@pytest.fixture
def haproxies(tmp_path):
    started = []

    def start(servers) -> HAProxy:
        proxy = HAProxy(tmp_path, servers)
        started.append(proxy)
        return proxy

    yield start
    for proxy in started:
        proxy.stop()


@pytest.fixture
def clients():
    started = []

    def start(url, **kwargs) -> ClientLoop:
        loop = ClientLoop(url, **kwargs)
        started.append(loop)
        return loop

    yield start
    for loop in started:
        loop.stop()


def test_shipped_config_is_valid_and_checks_health(tmp_path):
    import subprocess

    result = subprocess.run([haproxy_binary(), "-c", "-f", str(CONFIG)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    text = CONFIG.read_text()
    for line in ("option httpchk GET /health", "http-check expect status 200",
                 "option redispatch", "retries 3", "option http-buffer-request"):
        assert line in text
    assert len(re.findall(r"^\s*server \S+ \S+ check", text, re.M)) >= 2
    # The test's copy differs only in its addresses.
    ours = config_for({"a": "http://127.0.0.1:1", "b": "http://127.0.0.1:2"}, 3, 4)
    assert "bind 127.0.0.1:3" in ours and "server b 127.0.0.1:2 check" in ours


def _after_failover(loop: ClientLoop, since: float, healthy: str, count: int = 6):
    """The requests sent after `since`: wait for `count`, then all must have
    succeeded on the healthy server."""
    loop.wait_count(lambda o: o.sent_at >= since, count, timeout=120)
    later = loop.since(lambda o: o.sent_at >= since)
    failed = [o for o in later if not o.ok]
    assert not failed, f"requests failed after the check interval: {failed}"
    assert {o.server for o in later} == {healthy}, later


# -- against a stand-in that answers /health as the shim does ------------------


def test_standin_stalled_backend_stops_getting_traffic(haproxies, clients):
    with FakeServer() as sick, FakeServer() as well:
        proxy = haproxies({"sick": sick.url, "well": well.url})
        proxy.wait_status("sick", "UP")
        proxy.wait_status("well", "UP")
        loop = clients(proxy.url, timeout=10)
        loop.wait_count(lambda o: o.ok and o.server == "sick", 1, timeout=30)
        sick.completion, sick.health = HANG, HEALTH_STALLED  # livelocked, as the shim reports it
        stalled_at = time.monotonic()
        proxy.wait_status("sick", "DOWN", timeout=30)
        _after_failover(loop, stalled_at + CHECK_INTERVAL_S, "well")


def test_standin_loading_backend_gets_traffic_only_once_healthy(haproxies, clients):
    with FakeServer(health=HEALTH_LOADING) as loading, FakeServer() as well:
        proxy = haproxies({"loading": loading.url, "well": well.url})
        proxy.wait_status("loading", "DOWN")
        proxy.wait_status("well", "UP")
        loop = clients(proxy.url, timeout=10)
        _after_failover(loop, 0.0, "well")
        assert not loading.requests or all(r[0] == "GET" for r in loading.requests)
        loading.health = HEALTH_OK
        proxy.wait_status("loading", "UP")
        loop.wait_count(lambda o: o.ok and o.server == "loading", 1, timeout=30)


# -- against real shimmed stock servers ------------------------------------------


def _pair(servers, tiny_llama, tmp_path, version, sick_env):
    sick = servers(version, tiny_llama, env=sick_env)
    well = servers(version, tiny_llama)
    return sick, well


@pytest.mark.parametrize("version", VERSIONS)
def test_dead_backend_without_supervisor_fails_over(
        version, servers, tiny_llama, tmp_path, haproxies, clients):
    arm = tmp_path / "arm"
    sick, well = _pair(servers, tiny_llama, tmp_path, version,
                       fault_env("raise:typeerror:decode", arm))
    sick.warm_up()
    well.warm_up()
    proxy = haproxies({"sick": sick.url, "well": well.url})
    proxy.wait_status("sick", "UP")
    proxy.wait_status("well", "UP")
    loop = clients(proxy.url)
    loop.wait_count(lambda o: o.ok and o.server == "sick", 1, timeout=60)
    arm.touch()  # sick's generation thread dies at its next decode step; the shim exits
    assert sick.wait_exit(120) == 70, sick.log()[-3000:]
    died_at = time.monotonic()
    proxy.wait_status("sick", "DOWN", timeout=60)
    _after_failover(loop, died_at + CHECK_INTERVAL_S, "well")


@pytest.mark.parametrize("version", VERSIONS)
def test_livelocked_backend_fails_over(version, servers, tiny_llama, tmp_path, haproxies, clients):
    """The shim's /health turns 503 "stalled" when the loop livelocks (the
    livelock fault: the loop turns, nothing is delivered, upstream #1493)."""
    arm = tmp_path / "arm"
    env = dict(fault_env("livelock:batch", arm), MLX_HOTFIX_STALL_TIMEOUT="3")
    sick, well = _pair(servers, tiny_llama, tmp_path, version, env)
    sick.warm_up()
    well.warm_up()
    proxy = haproxies({"sick": sick.url, "well": well.url})
    proxy.wait_status("sick", "UP")
    proxy.wait_status("well", "UP")
    loop = clients(proxy.url, workers=3, timeout=60)
    loop.wait_count(lambda o: o.ok and o.server == "sick", 1, timeout=60)
    arm.touch()  # from now on sick's loop turns and delivers nothing, the process alive
    proxy.wait_status("sick", "DOWN", timeout=120)
    _after_failover(loop, time.monotonic(), "well")


@pytest.mark.parametrize("version", VERSIONS)
def test_loading_backend_gets_no_traffic_until_healthy(
        version, servers, tiny_llama, tmp_path, haproxies, clients):
    """The shim's /health says 503 "loading" until the model is loaded."""
    release = tmp_path / "release"
    env = dict(fault_env("hold:load"), MLX_TEST_FAULT_RELEASE_FILE=str(release))
    loading, well = _pair(servers, tiny_llama, tmp_path, version, env)
    loading.wait_listening()
    well.warm_up()
    proxy = haproxies({"loading": loading.url, "well": well.url})
    proxy.wait_status("loading", "DOWN")
    proxy.wait_status("well", "UP")
    loop = clients(proxy.url)
    _after_failover(loop, 0.0, "well")
    release.touch()  # the model load carries on
    proxy.wait_status("loading", "UP", timeout=120)
    loop.wait_count(lambda o: o.ok and o.server == "loading", 1, timeout=60)


# -- a client that hangs up behind HAProxy (issue 18) ----------------------------------

HUNG_UP = "mlx-hotfix: client hung up: stopped its generation after "


def _ask_through_and_hang_up(proxy_url: str, max_tokens: int, after: float) -> None:
    import json
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(proxy_url)
    body = json.dumps({"model": "default_model", "max_tokens": max_tokens, "temperature": 0.0,
                       "messages": [{"role": "user", "content": "a long story"}]}).encode()
    with socket.create_connection((parts.hostname, parts.port)) as client:
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                       b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                       % len(body) + body)
        time.sleep(after)  # then close: the client gave up


@pytest.mark.parametrize("version", VERSIONS[-1:])
def test_a_client_hang_up_reaches_the_server_through_haproxy(
        version, servers, tiny_llama, tmp_path, haproxies):
    # The shim's `disconnect` part stops the generation of a non-streaming
    # client that hung up. Behind HAProxy, the server's peer is HAProxy: the
    # hang-up must travel through it (the shipped config's abortonclose).
    server = servers(version, tiny_llama, args=("--decode-concurrency", "1",
                                                "--prompt-concurrency", "1"))
    server.warm_up()
    proxy = haproxies({"only": server.url})
    proxy.wait_status("only", "UP")
    _ask_through_and_hang_up(proxy.url, max_tokens=4000, after=1.0)
    deadline = time.monotonic() + 120
    while not any(line.startswith(HUNG_UP) for line in server.hotfix_lines()):
        assert time.monotonic() < deadline, (
            "the server never saw the hang-up through HAProxy:\n" + server.log()[-2000:])
        time.sleep(0.2)
    stopped_after = int(next(line for line in server.hotfix_lines()
                             if line.startswith(HUNG_UP))[len(HUNG_UP):].split()[0])
    assert stopped_after < 2000
