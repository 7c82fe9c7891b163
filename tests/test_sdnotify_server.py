"""systemd's own watchdog: the shim speaks sd_notify from the real stock
server's generation loop. A real Unix datagram socket stands in for systemd."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tests.conftest import fault_env
from harness.server import VERSIONS, BackgroundRequest

pytestmark = pytest.mark.server


class FakeSystemd:
    """Binds NOTIFY_SOCKET and records every datagram with its arrival time."""

    def __init__(self, path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.messages = []  # (monotonic time, text)
        self._stop = False
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self):
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            for line in data.decode().splitlines():
                self.messages.append((time.monotonic(), line))

    def texts(self, since=0.0):
        return [text for at, text in list(self.messages) if at >= since]

    def pings(self, since=0.0):
        return self.texts(since).count("WATCHDOG=1")

    def wait_for(self, text, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.texts():
                return True
            time.sleep(0.05)
        return False

    def close(self):
        self._stop = True
        self.sock.close()


@pytest.fixture
def systemd(tmp_path):
    fake = FakeSystemd(tmp_path / "notify.sock")
    yield fake
    fake.close()


def _wait_for_log(server, text, timeout=60):
    deadline = time.monotonic() + timeout
    while text not in server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    return text in server.log()


@pytest.mark.parametrize("version", VERSIONS)
def test_ready_then_pings_idle_and_decoding_then_silence_when_the_loop_hangs(
        servers, tiny_llama, tmp_path, systemd, version):
    arm = tmp_path / "arm"
    env = fault_env("hang:decode", arm)
    env.update({"NOTIFY_SOCKET": systemd.path, "WATCHDOG_USEC": "1000000"})  # ping every 0.5 s
    server = servers(version, tiny_llama, env=env)

    assert systemd.wait_for("READY=1"), (systemd.texts(), server.log())
    texts = systemd.texts()
    assert texts.index("STATUS=loading the model") < texts.index("READY=1")
    server.warm_up()  # the model READY announced answers

    idle_from = time.monotonic()
    time.sleep(3)
    assert systemd.pings(idle_from) >= 2, systemd.texts(idle_from)

    decode_from = time.monotonic()
    response = server.chat("a long one", max_tokens=3000, timeout=300)
    assert response.json()["usage"]["completion_tokens"] == 3000  # seconds of decoding
    assert systemd.pings(decode_from) >= 2, systemd.texts(decode_from)

    arm.touch()
    BackgroundRequest(lambda: server.chat("this one hangs", max_tokens=50, timeout=60))
    assert _wait_for_log(server, "mlx-test-fault: hang at decode")
    time.sleep(1)  # a ping already in flight
    hung_from = time.monotonic()
    time.sleep(4)
    assert systemd.pings(hung_from) == 0, systemd.texts(hung_from)
    assert server.alive()  # alive but silent: systemd's WatchdogSec= fires


def test_no_ready_when_the_model_does_not_load(servers, tmp_path, systemd):
    env = {"NOTIFY_SOCKET": systemd.path, "WATCHDOG_USEC": "1000000"}
    server = servers("0.32.2", tmp_path / "missing-model", env=env)
    assert server.wait_exit(120) == 70
    texts = systemd.texts()
    assert "READY=1" not in texts and "WATCHDOG=1" not in texts, server.log()
    assert "STOPPING=1" in texts
