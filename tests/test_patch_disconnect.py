"""disconnect: a non-streaming client that hangs up stops its generation
(upstream #677). Real stock 0.31.3 and 0.32.2 servers with one decode slot
(--decode-concurrency 1 --prompt-concurrency 1: stock's completion batch is
the larger of the two). Decode steps are counted by the fault injector
(MLX_TEST_DECODE_COUNT_FILE); no timing is asserted."""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.conftest import FAULTS_DIR
from harness.server import SHIM_DIR, VERSIONS, sse_events

pytestmark = pytest.mark.server

ONE_SLOT = ("--decode-concurrency", "1", "--prompt-concurrency", "1")
LONG = 4000
CANCEL_LINE = "mlx-hotfix: client hung up: stopped its generation after "


def _env(count_file, **extra):
    env = {"PYTHONPATH": "%s:%s" % (SHIM_DIR, FAULTS_DIR),
           "MLX_TEST_DECODE_COUNT_FILE": str(count_file)}
    env.update(extra)
    return env


def _steps(count_file) -> int:
    try:
        return int(count_file.read_text())
    except (OSError, ValueError):
        return 0


def _ask_and_hang_up(server, max_tokens=LONG, after=0.5) -> None:
    body = json.dumps({"model": "default_model", "max_tokens": max_tokens, "temperature": 0.0,
                       "messages": [{"role": "user", "content": "a long story"}]}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as client:
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                       b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                       % len(body) + body)
        time.sleep(after)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_client_that_hangs_up_stops_its_generation(servers, tiny_llama, tmp_path, version):
    count = tmp_path / "decode-steps"
    server = servers(version, tiny_llama, args=ONE_SLOT, env=_env(count))
    server.warm_up()
    assert "disconnect applied" in server.hotfix_lines()[0]
    _ask_and_hang_up(server)
    b = server.chat("b", max_tokens=1, timeout=300)
    assert b.status_code == 200
    served_at = _steps(count)
    # One slot: stock serves B only after A's 4000 tokens. A was stopped.
    assert served_at < LONG // 2, (served_at, server.log()[-2000:])
    lines = [l for l in server.hotfix_lines() if l.startswith(CANCEL_LINE)]
    assert len(lines) == 1 and lines[0].endswith("(1 cancelled so far)"), server.hotfix_lines()
    assert int(lines[0][len(CANCEL_LINE):].split()[0]) < LONG // 2
    # Nothing more runs for A, and the server serves on.
    assert server.chat("c", max_tokens=3).status_code == 200
    assert _steps(count) < LONG // 2
    assert "Traceback" not in server.log()


@pytest.mark.parametrize("version", VERSIONS)
def test_stock_keeps_generating_for_a_client_that_hung_up(servers, tiny_llama, tmp_path, version):
    # The bug, reproduced with the part off: A's decode steps keep coming.
    count = tmp_path / "decode-steps"
    server = servers(version, tiny_llama, args=ONE_SLOT,
                     env=_env(count, MLX_HOTFIX_DISABLE="disconnect"))
    server.warm_up()
    _ask_and_hang_up(server)
    seen = _steps(count)
    deadline = time.monotonic() + 120
    while _steps(count) < seen + 50:  # still generating for nobody
        assert time.monotonic() < deadline, "A's generation stopped on stock?"
        time.sleep(0.2)
    assert not any(l.startswith(CANCEL_LINE) for l in server.hotfix_lines())


@pytest.mark.parametrize("version", VERSIONS)
def test_connected_and_streaming_clients_get_their_whole_answer(servers, tiny_llama, tmp_path,
                                                                version):
    count = tmp_path / "decode-steps"
    server = servers(version, tiny_llama, args=ONE_SLOT, env=_env(count))
    server.warm_up()
    plain = server.chat("a long story", max_tokens=300, timeout=300)
    assert plain.status_code == 200
    assert plain.json()["usage"]["completion_tokens"] == 300
    assert plain.json()["choices"][0]["finish_reason"] == "length"
    stream = server.chat("a long story", max_tokens=300, stream=True, timeout=300)
    events = sse_events(stream.content)
    assert stream.status_code == 200 and events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert not any(l.startswith(CANCEL_LINE) for l in server.hotfix_lines())


WATCHER_FAILED = "mlx-hotfix: the disconnect watcher failed on a hung-up client (RuntimeError: "


@pytest.mark.parametrize("version", VERSIONS)
def test_the_watcher_survives_a_raising_stop_and_says_so_once(servers, tiny_llama, tmp_path,
                                                             version):
    count = tmp_path / "decode-steps"
    server = servers(version, tiny_llama, args=ONE_SLOT,
                     env=_env(count, MLX_TEST_SHIM_FAULT="stop-once"))
    server.warm_up()
    _ask_and_hang_up(server, max_tokens=300)  # its stop() raises
    deadline = time.monotonic() + 120
    while not any(l.startswith(WATCHER_FAILED) for l in server.hotfix_lines()):
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.1)
    _ask_and_hang_up(server)  # the watcher still watches: this one is stopped
    assert server.chat("c", max_tokens=1, timeout=300).status_code == 200
    lines = server.hotfix_lines()
    assert [l for l in lines if l.startswith(WATCHER_FAILED)] == [
        WATCHER_FAILED + "injected: ctx.stop failed); it goes on (said once)"]
    cancelled = [l for l in lines if l.startswith(CANCEL_LINE)]
    assert len(cancelled) == 1 and cancelled[0].endswith("(1 cancelled so far)"), lines
    assert _steps(count) < 300 + LONG // 2


SELECT_FAILS = """
import selectors, sys, threading
sys.path.insert(0, sys.argv[1])
from mlx_hotfix.patches import disconnect

failures, pauses, done = [5], [], threading.Event()

class FailingSelector:
    def register(self, *args): pass
    def select(self):
        if failures[0]:
            failures[0] -= 1
            raise OSError(9, "Bad file descriptor")
        done.set()
        threading.Event().wait()

selectors.DefaultSelector = FailingSelector
disconnect._pause = pauses.append
disconnect._Watcher()
assert done.wait(60)
print(pauses)
"""


def test_a_select_that_keeps_failing_is_retried_after_a_growing_pause(envs):
    from harness.server import run_python

    done = run_python(VERSIONS[-1], SELECT_FAILS, shim=False, args=[str(SHIM_DIR)])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[0.05, 0.1, 0.2, 0.4, 0.8]"
    assert done.stderr.count("the disconnect watcher failed on select (OSError") == 1
