"""socket: the server serves on a listening socket it was given, so the
socket outlives the server process. Proved with a real socket-passing
launcher, systemd's own `systemd-socket-activate` (the protocol of a
.socket unit: LISTEN_FDS, LISTEN_PID, fd 3), on the real stock servers;
every kind of wrong fd is named and exits 70, never a bind elsewhere. The
launchd side (launch_activate_socket through ctypes) runs against a C
stand-in with the documented signature, since there is no macOS here.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import requests

from harness import SHIM_DIR
from harness.procs import chat, kill_group
from harness.server import VERSIONS, free_port, python_for

pytestmark = pytest.mark.server

ACTIVATE = shutil.which("systemd-socket-activate")
LOAD_S = 120


def _socket_activate() -> str:
    if ACTIVATE is None:
        if os.environ.get("CI") == "true":
            pytest.fail("systemd-socket-activate is missing: .ci/run installs Debian's systemd")
        pytest.skip("systemd-socket-activate not installed (apt-get install systemd)")
    return ACTIVATE


def _server_argv(version: str, model: Path, port: int) -> list:
    return [str(python_for(version)), "-m", "mlx_lm", "server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port)]


def _shim_env(tmp_path: Path, shim: bool = True) -> dict:
    env = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "MLX_HOTFIX_REPORT_DIR": str(tmp_path / "reports")}
    if shim:
        env["PYTHONPATH"] = str(SHIM_DIR)
    return env


class Launched:
    """A launcher (and the server it execs) in its own process group, logged."""

    def __init__(self, argv: list, log: Path, env: dict | None = None):
        self.log_path = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float = LOAD_S):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        kill_group(self.proc)


@pytest.fixture
def launched():
    started = []

    def start(*args, **kwargs) -> Launched:
        proc = Launched(*args, **kwargs)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


def _activated(tmp_path, version, model, socket_port, server_port, *, shim=True, flags=()):
    argv = [_socket_activate(), "-l", f"127.0.0.1:{socket_port}", *flags]
    for key, value in _shim_env(tmp_path, shim).items():
        argv += ["-E", f"{key}={value}"]
    return argv + _server_argv(version, model, server_port)


def _refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            return False
    except ConnectionRefusedError:
        return True


@pytest.mark.parametrize("version", VERSIONS)
def test_the_server_adopts_the_socket_of_a_socket_passing_launcher(
        launched, tiny_llama, tmp_path, version):
    socket_port, own_port = free_port(), free_port()
    proc = launched(_activated(tmp_path, version, tiny_llama, socket_port, own_port),
                    tmp_path / "server.log")
    _until_logged(proc, "Listening on")
    # The launcher starts the server on the first connection: this request
    # waits in the socket's backlog through the whole model load.
    response = chat(f"http://127.0.0.1:{socket_port}", "hello", max_tokens=3, timeout=LOAD_S)
    assert response.status_code == 200, (response.text, proc.log())
    assert response.json()["usage"]["completion_tokens"] == 3
    assert (f"mlx-hotfix: serving on 127.0.0.1:{socket_port} (not --port {own_port}), the "
            "listening socket from systemd's protocol (LISTEN_FDS, fd 3)") in proc.log()
    assert _refused(own_port)  # no bind of its own
    health = requests.get(f"http://127.0.0.1:{socket_port}/health", timeout=10)
    assert health.status_code == 200, health.text


def test_stock_ignores_the_socket_it_was_given(launched, tiny_llama, tmp_path):
    """The control: stock binds its --port and never answers on the socket."""
    socket_port, own_port = free_port(), free_port()
    proc = launched(_activated(tmp_path, "0.32.2", tiny_llama, socket_port, own_port, shim=False),
                    tmp_path / "server.log")
    _until_logged(proc, "Listening on")
    with pytest.raises(requests.Timeout):
        # Starts the server; nobody ever accepts this connection.
        chat(f"http://127.0.0.1:{socket_port}", "hello", max_tokens=3, timeout=(5, 5))
    deadline = time.monotonic() + LOAD_S
    while _refused(own_port):  # stock serves its own port instead
        assert time.monotonic() < deadline and proc.proc.poll() is None, proc.log()
        time.sleep(0.2)
    with pytest.raises(requests.Timeout):
        chat(f"http://127.0.0.1:{socket_port}", "hello", max_tokens=3, timeout=(5, 5))


# A launcher that passes fd 3 with LISTEN_FDS/LISTEN_PID, like systemd, but
# puts something wrong there (or a right socket with a wrong count or pid).
WRONG_LAUNCHER = textwrap.dedent("""
    import os, socket, sys
    kind, argv = sys.argv[1], sys.argv[2:]
    count, pid = "1", str(os.getpid())
    def put3(fd):  # at fd 3, and passed on to the server
        if fd == 3:
            os.set_inheritable(3, True)
        else:
            os.dup2(fd, 3)
    def listening():
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        return s
    if kind == "closed":
        try:
            os.close(3)
        except OSError:
            pass
    elif kind == "file":
        put3(os.open(os.devnull, os.O_RDONLY))
    elif kind == "not-listening":
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        put3(s.fileno())
    elif kind == "two":
        s = listening()
        put3(s.fileno())
        os.dup2(3, 4)
        count = "2"
    elif kind == "other-pid":
        s = listening()
        put3(s.fileno())
        pid = "1"
    os.environ["LISTEN_FDS"], os.environ["LISTEN_PID"] = count, pid
    os.execv(argv[0], argv)
""")

WRONG = {
    # Closed at exec: whatever the new interpreter opens next may land on fd 3.
    "closed": "systemd's protocol (LISTEN_FDS, fd 3): fd 3 is not ",
    "file": "systemd's protocol (LISTEN_FDS, fd 3): fd 3 is not a socket",
    "not-listening": "fd 3 is not listening (listen() was never called)",
    "two": "LISTEN_FDS=2: mlx_lm.server serves exactly one listening socket",
    "datagram": "fd 3 is a SOCK_DGRAM socket, not a stream (TCP) one",
    "unix": "fd 3 is a AF_UNIX socket, not TCP over IPv4 or IPv6",
}


@pytest.mark.parametrize("kind", list(WRONG))
def test_a_wrong_inherited_fd_is_named_and_exits_70(launched, tiny_llama, tmp_path, kind):
    own_port = free_port()
    server = _server_argv("0.32.2", tiny_llama, own_port)
    if kind == "datagram":  # systemd-socket-activate itself, with a UDP socket
        port = free_port()
        proc = launched(_activated(tmp_path, "0.32.2", tiny_llama, port, own_port,
                                   flags=["--datagram"]), tmp_path / "server.log")
        _until_logged(proc, "Listening on")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.sendto(b"start", ("127.0.0.1", port))
    elif kind == "unix":
        path = tmp_path / "s.sock"
        argv = [_socket_activate(), "-l", str(path)]
        for key, value in _shim_env(tmp_path).items():
            argv += ["-E", f"{key}={value}"]
        proc = launched(argv + server, tmp_path / "server.log")
        _until_logged(proc, "Listening on")
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(path))
            assert proc.wait() == 70, proc.log()
    else:
        beat = tmp_path / "heartbeat.json"
        env = {**os.environ, **_shim_env(tmp_path), "MLX_HOTFIX_HEARTBEAT_FILE": str(beat)}
        proc = launched([sys.executable, "-c", WRONG_LAUNCHER, kind, *server],
                        tmp_path / "server.log", env=env)
    assert proc.wait() == 70, proc.log()
    (line,) = [l for l in proc.log().splitlines() if "exiting 70" in l]
    assert WRONG[kind] in line and "never replaced by a bind of our own" in line, line
    assert _refused(own_port)
    if kind not in ("datagram", "unix"):
        # The cause the watchdog names this start-up failure by (the death field).
        death = json.loads(beat.read_text())["death"]
        assert WRONG[kind] in death["summary"] and death["during_startup"], death


def test_a_socket_for_another_process_is_not_taken(launched, tiny_llama, tmp_path):
    """LISTEN_PID names another process (systemd's rule): the server binds its own port."""
    own_port = free_port()
    env = {**os.environ, **_shim_env(tmp_path)}
    proc = launched([sys.executable, "-c", WRONG_LAUNCHER, "other-pid",
                     *_server_argv("0.32.2", tiny_llama, own_port)], tmp_path / "server.log",
                    env=env)
    response = _wait_answer(f"http://127.0.0.1:{own_port}", proc)
    assert response.status_code == 200
    assert "LISTEN_FDS is set for process 1, not this one" in proc.log()


def _until_logged(proc: Launched, text: str) -> None:
    deadline = time.monotonic() + 30
    while text not in proc.log():
        assert time.monotonic() < deadline and proc.proc.poll() is None, proc.log()
        time.sleep(0.05)


def _wait_answer(url: str, proc: Launched) -> requests.Response:
    deadline = time.monotonic() + LOAD_S
    while True:
        try:
            return chat(url, "hello", max_tokens=1, timeout=LOAD_S)
        except requests.ConnectionError:
            assert time.monotonic() < deadline and proc.proc.poll() is None, proc.log()
            time.sleep(0.2)


# -- launchd: launch_activate_socket through ctypes, against a C stand-in -------

# The signature and error codes of <launch.h> (macOS 10.10+), see
# mlx_hotfix/inherited_socket.py; the fds come from the environment.
FAKE_LAUNCH_C = r"""
#include <errno.h>
#include <stdlib.h>
#include <string.h>
int launch_activate_socket(const char *name, int **fds, size_t *cnt) {
    const char *fd = getenv("FAKE_LAUNCHD_FD");
    size_t n = strcmp(name, "Listeners") == 0 ? 1 : strcmp(name, "Both") == 0 ? 2 : 0;
    if (strcmp(name, "Outsider") == 0) return ESRCH;
    if (n == 0) return ENOENT;
    *fds = malloc(n * sizeof(int));
    for (size_t i = 0; i < n; i++) (*fds)[i] = atoi(fd);
    *cnt = n;
    return 0;
}
"""

LAUNCHD_CHECK = textwrap.dedent("""
    import ctypes, os, socket, sys
    from mlx_hotfix import inherited_socket as held
    library = ctypes.CDLL(sys.argv[1])
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    os.environ["FAKE_LAUNCHD_FD"] = str(server.fileno())
    sock, source = held.take(environ={}, launchd_name="Listeners", launchd=library)
    print(held.describe(sock) == "127.0.0.1:%d" % server.getsockname()[1], source)
    for name in ("Both", "Missing", "Outsider"):
        try:
            held.take(environ={}, launchd_name=name, launchd=library)
        except held.InheritedSocketError as exc:
            print(exc)
    try:
        held.launchd_sockets("Listeners")  # the real library: macOS only
    except held.InheritedSocketError as exc:
        print(exc)
""")


def test_launchd_sockets_through_ctypes(tmp_path):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler for the launch_activate_socket stand-in")
    library = tmp_path / "fakelaunch.so"
    source = tmp_path / "fakelaunch.c"
    source.write_text(FAKE_LAUNCH_C)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    result = subprocess.run([sys.executable, "-c", LAUNCHD_CHECK, str(library)],
                            env={"PYTHONPATH": str(SHIM_DIR), "MLX_HOTFIX": "0",
                                 "PATH": os.environ["PATH"]},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "True launchd (Sockets entry 'Listeners')", lines
    assert "2 sockets; mlx_lm.server serves exactly one" in lines[1]
    assert "launch_activate_socket('Missing') failed: ENOENT (the job's plist has no " \
           "Sockets entry of that name)" == lines[2]
    assert "ESRCH (this process was not started by launchd" in lines[3]
    if sys.platform != "darwin":
        assert "launchd sockets exist on macOS only" in lines[4]
