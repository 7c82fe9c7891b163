"""sd_notify client of the shim (sitecustomize/mlx_hotfix/sdnotify.py).

The module is loaded from its file, so these tests do not import the rest of
mlx_hotfix (whose __init__ may install patches).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from harness.fakes import Clock

SDNOTIFY_PY = Path(__file__).resolve().parents[1] / "sitecustomize" / "mlx_hotfix" / "sdnotify.py"

pytestmark = pytest.mark.skipif(not hasattr(socket, "AF_UNIX"), reason="needs AF_UNIX")


def _load():
    spec = importlib.util.spec_from_file_location("_sdnotify_under_test", SDNOTIFY_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sdnotify = _load()
SdNotifier = sdnotify.SdNotifier


@pytest.fixture
def listener(tmp_path):
    # AF_UNIX paths are limited to ~108 bytes; tmp_path can be long.
    path = tmp_path / "n.sock"
    if len(str(path)) > 100:
        path = Path("/tmp") / f"sdn-{uuid.uuid4().hex[:12]}.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)
    yield str(path), sock
    sock.close()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def received(sock) -> list:
    out = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except BlockingIOError:
            return out


def test_disabled_without_notify_socket():
    n = SdNotifier(environ={})
    assert not n.enabled
    assert n.notify("READY=1") is False
    assert n.ready("x") is False
    assert n.status("x") is False
    assert n.watchdog_ping() is False
    assert n.stopping() is False
    assert n.watchdog_enabled is False
    assert n.min_interval == 1.0


def test_relative_notify_socket_is_ignored():
    n = SdNotifier(environ={"NOTIFY_SOCKET": "relative/path"})
    assert not n.enabled
    assert n.notify("READY=1") is False


def test_ready_status_stopping_arrive(listener):
    path, sock = listener
    n = SdNotifier(environ={"NOTIFY_SOCKET": path})
    assert n.enabled
    assert n.ready() is True
    assert n.ready("model loaded") is True
    assert n.status("serving\n2 requests") is True
    assert n.stopping() is True
    assert n.notify("EXTEND_TIMEOUT_USEC=1000000") is True
    assert received(sock) == [
        "READY=1",
        "READY=1\nSTATUS=model loaded",
        "STATUS=serving 2 requests",
        "STOPPING=1",
        "EXTEND_TIMEOUT_USEC=1000000",
    ]


def test_from_environ(listener, monkeypatch):
    path, sock = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "10000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    n = SdNotifier.from_environ()
    assert n.enabled and n.watchdog_enabled and n.min_interval == 5.0
    assert n.watchdog_ping() is True
    assert received(sock) == ["WATCHDOG=1"]
    assert SdNotifier.from_environ({}).enabled is False


def test_socket_is_cached(listener):
    path, sock = listener
    n = SdNotifier(environ={"NOTIFY_SOCKET": path})
    n.status("a")
    first = n._sock
    n.status("b")
    assert n._sock is first
    assert received(sock) == ["STATUS=a", "STATUS=b"]


def test_watchdog_ping_rate_limited_with_injected_clock(listener):
    path, sock = listener
    clock = Clock()
    n = SdNotifier(environ={"NOTIFY_SOCKET": path}, clock=clock, min_interval=5)
    assert n.watchdog_ping() is True
    assert n.watchdog_ping() is False  # same instant
    clock.now += 4.9
    assert n.watchdog_ping() is False
    clock.now += 0.1
    assert n.watchdog_ping() is True
    clock.now += 100
    assert n.watchdog_ping() is True
    assert received(sock) == ["WATCHDOG=1"] * 3


def test_min_interval_defaults_to_half_watchdog_usec(listener):
    path, _ = listener
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "60000000", "WATCHDOG_PID": str(os.getpid())}
    n = SdNotifier(environ=env)
    assert n.watchdog_enabled is True
    assert n.watchdog_usec == 60_000_000
    assert n.min_interval == 30.0
    # WATCHDOG_PID unset also means "this process".
    env.pop("WATCHDOG_PID")
    assert SdNotifier(environ=env).min_interval == 30.0


def test_watchdog_for_another_pid_is_not_ours(listener):
    path, _ = listener
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "60000000", "WATCHDOG_PID": str(os.getpid() + 1)}
    n = SdNotifier(environ=env)
    assert n.watchdog_enabled is False
    assert n.min_interval == 1.0


def test_bad_watchdog_usec_is_ignored(listener):
    path, _ = listener
    for value in ("", "abc", "0", "-5"):
        n = SdNotifier(environ={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": value})
        assert n.watchdog_enabled is False
        assert n.min_interval == 1.0


def test_watchdog_rate_limit_default_interval(listener):
    path, sock = listener
    clock = Clock()
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000"}
    n = SdNotifier(environ=env, clock=clock)
    assert n.min_interval == 2.0
    sent = []
    for _ in range(50):  # 50 loop iterations, 0.1 s apart = 5 s
        sent.append(n.watchdog_ping())
        clock.now += 0.1
    assert sent.count(True) == 3  # t = 0, 2, 4
    assert len(received(sock)) == 3


def test_abstract_namespace():
    name = f"mlx-hotfix-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind("\0" + name)
    except OSError as exc:  # e.g. macOS has no abstract namespace
        sock.close()
        pytest.skip(f"abstract AF_UNIX not available: {exc}")
    sock.setblocking(False)
    try:
        n = SdNotifier(environ={"NOTIFY_SOCKET": "@" + name})
        assert n.ready() is True
        assert received(sock) == ["READY=1"]
    finally:
        sock.close()


def test_missing_socket_returns_false(tmp_path):
    n = SdNotifier(environ={"NOTIFY_SOCKET": str(tmp_path / "nobody-listens.sock")})
    assert n.enabled
    assert n.notify("READY=1") is False
    assert n.ready("x") is False
    assert n.watchdog_ping() is False
    assert n.stopping() is False


def test_failed_ping_does_not_consume_interval(tmp_path):
    path = tmp_path / "late.sock"
    if len(str(path)) > 100:
        path = Path("/tmp") / f"sdn-{uuid.uuid4().hex[:12]}.sock"
    clock = Clock()
    n = SdNotifier(environ={"NOTIFY_SOCKET": str(path)}, clock=clock, min_interval=10)
    assert n.watchdog_ping() is False  # nobody listening yet
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)
    try:
        assert n.watchdog_ping() is True  # retried at once, not 10 s later
        assert received(sock) == ["WATCHDOG=1"]
    finally:
        sock.close()
        os.unlink(path)


def test_recovers_after_listener_is_recreated(listener):
    path, sock = listener
    n = SdNotifier(environ={"NOTIFY_SOCKET": path})
    assert n.status("one") is True
    assert received(sock) == ["STATUS=one"]
    sock.close()
    os.unlink(path)
    assert n.status("lost") is False
    again = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    again.bind(path)
    again.setblocking(False)
    try:
        assert n.status("two") is True
        assert received(again) == ["STATUS=two"]
    finally:
        again.close()


def test_import_is_cheap_and_stdlib_only():
    # Importing the module must not pull in socket (or anything else new).
    code = (
        "import sys, importlib.util\n"
        "before = set(sys.modules)\n"
        f"spec = importlib.util.spec_from_file_location('sdn', {str(SDNOTIFY_PY)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "m.SdNotifier(environ={}).watchdog_ping()\n"
        "new = sorted(set(sys.modules) - before - {'sdn'})\n"
        "print(new)\n"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[]"
