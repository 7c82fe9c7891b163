"""drain: the first SIGTERM lets every accepted request finish, refuses new
ones (503 with Retry-After), says "draining" on /health, then the process
dies of the signal. A drain timeout shorter than the work, a hung loop, a
second SIGTERM and SIGINT answer everyone at once instead (issue 18: SIGINT
left streams cut and plain requests unanswered). Real stock servers.

No timing assertions: where the point is "promptly", the drain timeout is
set far beyond the clients' own timeout, so that only the rule under test
(no progress, a second signal) can end the drain in time.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import requests

from harness.server import VERSIONS, BackgroundRequest, sse_events
from tests.conftest import arm_fault, fault_env

pytestmark = pytest.mark.server

CLIENT_TIMEOUT = 120
# Two decode slots (the batch is max(decode, prompt concurrency)): of eight
# requests two decode and six wait for a slot, all accepted.
TWO_SLOTS = ["--decode-concurrency", "2", "--prompt-concurrency", "2"]
LONG = 400  # tokens: four rounds of two are still at work when the signal comes


def _env(tmp_path: Path, **extra) -> dict:
    return {"MLX_HOTFIX_HEARTBEAT_FILE": str(tmp_path / "heartbeat.json"),
            "MLX_HOTFIX_HEARTBEAT_INTERVAL": "0.05",
            "MLX_HOTFIX_REPORT_DIR": str(tmp_path / "reports"), **extra}


def _record(tmp_path: Path) -> dict:
    try:
        return json.loads((tmp_path / "heartbeat.json").read_text())
    except (OSError, ValueError):
        return {}


def _held(record: dict) -> int:
    """Requests the server accepted: generating (in ResponseGenerator.generate)
    or waiting in the admission part's line for a slot."""
    return (record.get("in_flight") or 0) + (record.get("queued") or 0)


def _wait_in_flight(server, tmp_path: Path, count: int) -> dict:
    """Until the server holds `count` requests; the heartbeat record then."""
    deadline = time.monotonic() + CLIENT_TIMEOUT
    while _held(record := _record(tmp_path)) < count:
        assert time.monotonic() < deadline, f"never {count} in flight:\n{server.log()[-3000:]}"
        assert server.alive(), server.log()[-3000:]
        time.sleep(0.05)
    return record


def _send_eight(server, max_tokens: int = LONG):
    streams = [BackgroundRequest(
        lambda: server.chat("tell me a story", max_tokens=max_tokens, stream=True,
                            timeout=CLIENT_TIMEOUT), name=f"stream{i}") for i in range(4)]
    plains = [BackgroundRequest(
        lambda: server.chat("tell me a story", max_tokens=max_tokens, timeout=CLIENT_TIMEOUT),
        name=f"plain{i}") for i in range(4)]
    return streams, plains


def _hold_env(tmp_path: Path) -> dict:
    """The harness fault that holds the first decode step after arming until
    the release file exists (see _send_eight_together)."""
    return {**fault_env("hold:decode", tmp_path / "arm"), "MLX_TEST_FAULT_ONESHOT": "1",
            "MLX_TEST_FAULT_RELEASE_FILE": str(tmp_path / "release")}


def _send_eight_together(server, tmp_path: Path):
    """The eight, all in the server before any is served (left to timing, a
    loaded machine finished the first before the last came): the first decode
    step waits until /health counts all eight, then they go."""
    arm_fault(tmp_path / "arm")
    sent = _send_eight(server)
    deadline = time.monotonic() + CLIENT_TIMEOUT
    while True:
        health = requests.get(f"{server.url}/health", timeout=10).json()
        if (health.get("in_flight") or 0) + (health.get("queued") or 0) >= 8:
            break
        assert time.monotonic() < deadline, f"never 8 in the server:\n{server.log()[-3000:]}"
        time.sleep(0.05)
    (tmp_path / "release").touch()
    return sent


def _completed_stream(request: BackgroundRequest, tokens: int) -> bool:
    assert request.join(CLIENT_TIMEOUT + 10), f"{request} hangs"
    assert request.error is None, request
    if request.status == 503:  # answered before its stream began
        assert request.json()["error"]["code"] == 503, request
        return False
    assert request.status == 200, request
    events = sse_events(request.body)
    if events[-1] == "[DONE]":
        deltas = [e for e in events if isinstance(e, dict) and e.get("choices")
                  and e["choices"][0].get("delta", {}).get("content")]
        assert len(deltas) >= tokens - 2, (len(deltas), request)  # every token, in full
        return True
    assert isinstance(events[-1], dict) and events[-1]["error"]["code"] == 503, events[-3:]
    return False


def _completed_plain(request: BackgroundRequest, tokens: int) -> bool:
    assert request.join(CLIENT_TIMEOUT + 10), f"{request} hangs"
    assert request.error is None, request
    if request.status == 200:
        assert request.json()["usage"]["completion_tokens"] == tokens, request
        return True
    assert request.status == 503 and request.json()["error"]["code"] == 503, request
    return False


def _hotfix(server, text: str) -> list:
    return [line for line in server.hotfix_lines() if text in line]


@pytest.mark.parametrize("version", VERSIONS)
def test_sigterm_drains_accepted_requests_refuses_new_ones_then_dies_of_it(
        servers, tiny_llama, tmp_path, version):
    server = servers(version, tiny_llama, args=TWO_SLOTS,
                     env=_env(tmp_path, MLX_HOTFIX_DRAIN_TIMEOUT="600", **_hold_env(tmp_path)))
    server.warm_up()
    streams, plains = _send_eight_together(server, tmp_path)
    record = _wait_in_flight(server, tmp_path, 8)
    # Two decode, six wait for a slot in the admission part's line: accepted
    # too, so they finish through the drain as well.
    assert (record["in_flight"], record["queued"]) == (2, 6), record
    server.proc.send_signal(signal.SIGTERM)

    late = server.chat("a new request", max_tokens=2)
    assert late.status_code == 503, late.text
    assert int(late.headers["Retry-After"]) >= 1
    assert "restarting" in late.json()["error"]["message"]
    assert late.json()["error"]["code"] == 503
    health = requests.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "draining", health.text
    # The draining body keeps memory and the admission part's counts.
    assert {"memory", "queued", "running"} <= set(health.json()), health.text
    live = requests.get(f"{server.url}/health/live", timeout=10)
    assert live.status_code == 200 and live.json()["phase"] == "draining", live.text

    assert all(_completed_stream(r, LONG) for r in streams), streams
    assert all(_completed_plain(r, LONG) for r in plains), plains
    assert server.wait_exit(60) == -signal.SIGTERM, server.log()[-3000:]
    assert _hotfix(server, "draining: 8 request(s) to finish"), server.hotfix_lines()
    (over,) = _hotfix(server, "drain over")
    assert "8 request(s) finished, 0 cut" in over and "1 new one(s) refused" in over, over


def test_a_drain_on_its_own_port_answers_503_while_requests_keep_coming(
        servers, tiny_llama, tmp_path):
    """No held socket (this server binds its port): with its work done, the
    draining server keeps the port open, /health 503 "draining" and new
    requests 503, while new requests keep coming, so a load balancer takes it
    out before the port closes (closing at once reset what HAProxy had sent
    meanwhile: 502 for its clients, tests/test_haproxy_rolling.py). Without
    the quiet period the process is gone ~0.1 s after the signal, nothing in
    flight: the first of these requests meets a closed port."""
    server = servers(VERSIONS[-1], tiny_llama, env=_env(
        tmp_path, MLX_HOTFIX_DRAIN_TIMEOUT="600", MLX_HOTFIX_DRAIN_QUIET="600"))
    server.warm_up()
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + CLIENT_TIMEOUT
    while not _hotfix(server, "draining:"):
        assert time.monotonic() < deadline and server.alive(), server.log()[-3000:]
        time.sleep(0.05)
    for _ in range(5):
        health = requests.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "draining", health.text
        late = server.chat("a new request", max_tokens=2)
        assert late.status_code == 503 and "restarting" in late.json()["error"]["message"]
        assert int(late.headers["Retry-After"]) >= 1
    assert server.alive() and not _hotfix(server, "drain over"), server.log()[-3000:]
    (line,) = _hotfix(server, "draining:")
    assert "until no new one came for 600s" in line, line
    server.proc.send_signal(signal.SIGTERM)  # a second one stops at once, as always
    assert server.wait_exit(60) == -signal.SIGTERM, server.log()[-3000:]


@pytest.mark.parametrize("version", VERSIONS)
def test_a_drain_timeout_shorter_than_the_work_answers_the_rest(
        servers, tiny_llama, tmp_path, version):
    server = servers(version, tiny_llama, args=TWO_SLOTS,
                     env=_env(tmp_path, MLX_HOTFIX_DRAIN_TIMEOUT="1"))
    server.warm_up()
    long = 20000  # far more than a second's work for two slots
    streams, plains = _send_eight(server, long)
    _wait_in_flight(server, tmp_path, 8)
    server.proc.send_signal(signal.SIGTERM)
    done = [_completed_stream(r, long) for r in streams] + [
        _completed_plain(r, long) for r in plains]
    assert not any(done), (streams, plains)  # every one answered, none hangs
    assert server.wait_exit(60) == -signal.SIGTERM, server.log()[-3000:]
    (over,) = _hotfix(server, "drain over")
    assert "0 request(s) finished, 8 cut (the drain timeout (1s) ran out)" in over, over


@pytest.mark.parametrize("version", VERSIONS)
def test_sigterm_while_the_loop_is_hung_answers_everyone_without_waiting_out_the_drain(
        servers, tiny_llama, tmp_path, version):
    arm = tmp_path / "arm"
    # The drain timeout is ten times the clients' own: only the no-progress
    # rule can answer them before they give up.
    env = {**fault_env("hang:decode:5", arm), **_env(tmp_path)}
    env["MLX_HOTFIX_DRAIN_TIMEOUT"] = str(CLIENT_TIMEOUT * 10)
    server = servers(version, tiny_llama, env=env)
    server.warm_up()
    arm.touch()
    stream = BackgroundRequest(lambda: server.chat("x", max_tokens=200, stream=True,
                                                   timeout=CLIENT_TIMEOUT), name="stream")
    plain = BackgroundRequest(lambda: server.chat("y", max_tokens=200, timeout=CLIENT_TIMEOUT),
                              name="plain")
    deadline = time.monotonic() + CLIENT_TIMEOUT
    while "mlx-test-fault: hang" not in server.log():
        assert time.monotonic() < deadline and server.alive(), server.log()[-3000:]
        time.sleep(0.1)
    server.proc.send_signal(signal.SIGTERM)
    assert not _completed_stream(stream, 200)
    assert not _completed_plain(plain, 200)
    assert server.wait_exit(60) == -signal.SIGTERM, server.log()[-3000:]
    (over,) = _hotfix(server, "drain over")
    assert "nothing delivered for" in over and "2 cut" in over, over


@pytest.mark.parametrize("version", VERSIONS)
def test_a_second_sigterm_answers_everyone_at_once(servers, tiny_llama, tmp_path, version):
    server = servers(version, tiny_llama,
                     env=_env(tmp_path, MLX_HOTFIX_DRAIN_TIMEOUT=str(CLIENT_TIMEOUT * 10)))
    server.warm_up()
    stream = BackgroundRequest(lambda: server.chat("x", max_tokens=50000, stream=True,
                                                   timeout=CLIENT_TIMEOUT), name="stream")
    plain = BackgroundRequest(lambda: server.chat("y", max_tokens=50000, timeout=CLIENT_TIMEOUT),
                              name="plain")
    _wait_in_flight(server, tmp_path, 2)
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + CLIENT_TIMEOUT
    while not _hotfix(server, "draining:"):
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    assert not _completed_stream(stream, 50000)
    assert not _completed_plain(plain, 50000)
    assert server.wait_exit(60) == -signal.SIGTERM, server.log()[-3000:]
    assert not _hotfix(server, "drain over")  # the second signal took over


@pytest.mark.parametrize("version", VERSIONS)
def test_sigint_answers_every_client_then_dies_of_it(servers, tiny_llama, tmp_path, version):
    server = servers(version, tiny_llama, env=_env(tmp_path))
    server.warm_up()
    streams = [BackgroundRequest(lambda: server.chat("x", max_tokens=50000, stream=True,
                                                     timeout=CLIENT_TIMEOUT)) for _ in range(2)]
    plains = [BackgroundRequest(lambda: server.chat("y", max_tokens=50000,
                                                    timeout=CLIENT_TIMEOUT)) for _ in range(2)]
    _wait_in_flight(server, tmp_path, 4)
    server.proc.send_signal(signal.SIGINT)
    for request in streams:
        assert not _completed_stream(request, 50000)  # 200, then the error event
    for request in plains:
        assert not _completed_plain(request, 50000)  # 503 JSON
        assert "stopping" in request.json()["error"]["message"]
    assert server.wait_exit(60) == -signal.SIGINT, server.log()[-3000:]


def test_stock_cuts_its_clients_on_sigint(servers, tiny_llama, tmp_path):
    """The control for SIGINT: stock's KeyboardInterrupt leaves a stream cut
    short (no [DONE], no error event) and a plain request unanswered."""
    server = servers("0.32.2", tiny_llama, shim=False)
    server.warm_up()
    stream = BackgroundRequest(lambda: server.chat("x", max_tokens=50000, stream=True,
                                                   timeout=CLIENT_TIMEOUT))
    plain = BackgroundRequest(lambda: server.chat("y", max_tokens=50000, timeout=CLIENT_TIMEOUT))
    time.sleep(2.0)  # both admitted (stock has no heartbeat to tell)
    server.proc.send_signal(signal.SIGINT)
    assert stream.join(CLIENT_TIMEOUT) and plain.join(CLIENT_TIMEOUT)
    assert plain.status is None and plain.error is not None, plain
    events = sse_events(stream.body or b"")
    assert stream.error is not None or not events or (
        events[-1] != "[DONE]" and not (isinstance(events[-1], dict) and "error" in events[-1])
    ), events[-3:]
