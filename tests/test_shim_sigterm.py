"""SIGTERM (a supervisor's restart, systemd's stop, mlx.launch stopping the
other ranks of a group) without a drain (MLX_HOTFIX_DRAIN_TIMEOUT=0, which
is also what a second SIGTERM, a SIGINT and a group get): with the shim every
waiting client is answered 503 (or a final SSE error event) before the
process dies of the signal; stock resets them. Real stock servers, a long
decode in flight. The drain itself: test_shim_drain.py."""

from __future__ import annotations

import signal
import time

import pytest

from harness.server import VERSIONS, BackgroundRequest

pytestmark = pytest.mark.server

LONG = 3000  # tokens: the decode is still running when the signal comes


def _long_request(server, *, stream=False):
    return BackgroundRequest(
        lambda: server.chat("tell me a long story", max_tokens=LONG, timeout=120,
                            stream=stream),
        name="long")


def _decoding(server):
    # The request is in flight once the server has started on it: give it a
    # moment to be admitted (a 1-token request behind it would wait).
    time.sleep(1.0)
    assert server.alive(), server.log()[-2000:]


@pytest.mark.parametrize("version", VERSIONS)
def test_sigterm_answers_every_waiting_client_then_dies_of_the_signal(
        servers, tiny_llama, version):
    server = servers(version, tiny_llama, env={"MLX_HOTFIX_DRAIN_TIMEOUT": "0"})
    server.warm_up()
    plain, streamed = _long_request(server), _long_request(server, stream=True)
    _decoding(server)
    server.proc.send_signal(signal.SIGTERM)
    assert plain.join(60) and streamed.join(60)
    assert plain.status == 503, plain
    assert "stopping" in plain.json()["error"]["message"]
    assert streamed.status == 200 and b"stopping" in (streamed.body or b""), streamed
    assert server.wait_exit(30) == -signal.SIGTERM  # dies of the signal, as stock would


def test_stock_resets_its_clients_on_sigterm(servers, tiny_llama):
    server = servers("0.32.2", tiny_llama, shim=False)
    server.warm_up()
    plain = _long_request(server)
    _decoding(server)
    server.proc.send_signal(signal.SIGTERM)
    assert plain.join(60)
    assert plain.status is None and plain.error is not None, plain  # no answer at all
    assert server.wait_exit(30) == -signal.SIGTERM
