"""Hardening of the shim on the real stock servers (issue 9, items 1, 4, 7, 15, 16).

A server that cannot bind its port must exit, not live on headless; the
heartbeat never follows a planted symlink and says once when it cannot be
written.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import requests

from harness.server import base_env
from tests.test_sdnotify_server import FakeSystemd


def _hold_a_port():
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    return holder, holder.getsockname()[1]


def _wait_for_text(server, text, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in server.log():
            return True
        if not server.alive():
            return text in server.log()
        time.sleep(0.1)
    return False


@pytest.mark.server
@pytest.mark.parametrize("version", ["0.31.3", "0.32.2"])
def test_stock_with_its_port_taken_lives_on_headless(servers, tiny_llama, version):
    holder, port = _hold_a_port()
    try:
        server = servers(version, tiny_llama, shim=False, port=port)
        assert _wait_for_text(server, "Address already in use"), server.log()
        time.sleep(1.0)
        assert server.alive(), "stock exited on its own: the bug is gone upstream?"
    finally:
        holder.close()


@pytest.mark.server
@pytest.mark.parametrize(
    "version,launch",
    [
        ("0.31.3", "python -m mlx_lm server"),
        ("0.32.2", "python -m mlx_lm server"),
        ("0.32.2", "python -m mlx_lm.server"),
        ("0.31.3", "mlx_lm.server"),
    ],
)
def test_a_server_that_cannot_bind_its_port_exits_70_and_is_never_ready(
    servers, tiny_llama, tmp_path, version, launch
):
    holder, port = _hold_a_port()
    systemd = FakeSystemd(tmp_path / "notify.sock")
    beat_file = tmp_path / "heartbeat.json"
    try:
        server = servers(
            version, tiny_llama, port=port, launch=launch,
            env={"NOTIFY_SOCKET": systemd.path, "MLX_HOTFIX_HEARTBEAT_FILE": str(beat_file),
                 "MLX_HOTFIX_HEARTBEAT_INTERVAL": "0.1"},
        )
        code = server.wait_exit(120)
        assert code == 70, server.log()
        assert "Address already in use" in server.log()
        assert any("main thread stopped" in line for line in server.hotfix_lines()), server.log()
        assert not any(t.startswith("READY=1") for t in systemd.texts()), systemd.texts()
        if beat_file.exists():
            assert json.loads(beat_file.read_text())["phase"] != "serving"
    finally:
        systemd.close()
        holder.close()


# -- the heartbeat's listener rule, at the unit level (the real bind is above) --

LISTENER_SCRIPT = textwrap.dedent("""
    import json, os, threading
    from mlx_hotfix import heartbeat
    path = os.environ["MLX_HOTFIX_HEARTBEAT_FILE"]

    class Generator:
        _generation_thread = threading.current_thread()

    heartbeat.watch_listener()
    heartbeat.generation_thread_started(Generator())
    heartbeat.loop_iteration()
    before = json.load(open(path))["phase"]
    heartbeat.listener_bound()
    heartbeat._next_write = 0
    heartbeat.loop_iteration()
    after = json.load(open(path))["phase"]
    print(json.dumps([before, after]))
""")


def test_serving_and_ready_wait_for_the_listener(tmp_path):
    systemd = FakeSystemd(tmp_path / "notify.sock")
    env = base_env(extra={"MLX_HOTFIX_HEARTBEAT_FILE": str(tmp_path / "hb.json"),
                          "NOTIFY_SOCKET": systemd.path})
    try:
        result = subprocess.run([sys.executable, "-c", LISTENER_SCRIPT], env=env,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == ["loading", "serving"]
        assert systemd.wait_for("READY=1", timeout=5)
        ready_at = [t for t in systemd.texts()].index("READY=1")
        assert "STATUS=serving" in systemd.texts()[ready_at:]
    finally:
        systemd.close()


# -- item 4 and 7/16 (shim side): the heartbeat file ----------------------------

WRITE_SCRIPT = textwrap.dedent("""
    import os, threading
    from mlx_hotfix import heartbeat

    victim = os.environ.get("VICTIM")
    if victim:  # another local user plants the old temp name, pid from ps
        path = os.environ["MLX_HOTFIX_HEARTBEAT_FILE"]
        os.symlink(victim, "%s.%d.tmp" % (path, os.getpid()))

    class Generator:
        _generation_thread = threading.current_thread()

    heartbeat.generation_thread_started(Generator())
    for _ in range(3):
        heartbeat._next_write = 0
        heartbeat.loop_iteration()
""")


def _run_writer(tmp_path, beat_file, **extra):
    env = base_env(extra={"MLX_HOTFIX_HEARTBEAT_FILE": str(beat_file), **extra})
    return subprocess.run([sys.executable, "-c", WRITE_SCRIPT], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)


def test_the_heartbeat_never_follows_a_planted_symlink(tmp_path):
    victim = tmp_path / "owners-file"
    victim.write_text("precious\n")
    beat_file = tmp_path / "hb.json"
    result = _run_writer(tmp_path, beat_file, VICTIM=str(victim))
    assert result.returncode == 0, result.stderr
    assert victim.read_text() == "precious\n"
    assert json.loads(beat_file.read_text())["phase"] in ("loading", "serving")
    assert not beat_file.is_symlink()
    leftovers = [p.name for p in tmp_path.iterdir()
                 if p.name.endswith(".tmp") and not p.is_symlink()]
    assert leftovers == []


@pytest.mark.parametrize("how", ["missing-directory", "a-directory"])
def test_an_unwritable_heartbeat_is_said_once(tmp_path, how):
    if how == "missing-directory":
        beat_file = tmp_path / "no" / "such" / "hb.json"
    else:
        beat_file = tmp_path / "hb.json"
        beat_file.mkdir()
    result = _run_writer(tmp_path, beat_file)
    assert result.returncode == 0, result.stderr
    lines = [l for l in result.stderr.splitlines() if "cannot write the heartbeat" in l]
    assert len(lines) == 1, result.stderr
    assert str(beat_file) in lines[0]


# -- item 3 (shim side): the server ends when its supervisor is gone ---------------

INTERMEDIATE = textwrap.dedent("""
    import os, subprocess, sys, time
    env = dict(os.environ, MLX_HOTFIX_PARENT_PID=str(os.getpid()))
    if sys.argv[1] == "off":
        env.pop("MLX_HOTFIX_PARENT_PID")
    child = subprocess.Popen([sys.executable, "-c",
                              "import mlx_lm, time; print('imported', flush=True); time.sleep(120)"],
                             env=env, start_new_session=True)
    print(child.pid, flush=True)
    time.sleep(120)
""")


@pytest.mark.parametrize("watch", ["on", "off"])
def test_the_shim_exits_when_its_supervisor_is_killed(tmp_path, watch):
    """macOS has no PR_SET_PDEATHSIG: the shim watches MLX_HOTFIX_PARENT_PID.
    (The supervisor here is a plain process that sets the variable and is
    then SIGKILLed; "off" shows the orphan a supervisor leaves without it.)"""
    import psutil
    from harness.server import python_for

    supervisor = subprocess.Popen([str(python_for("0.32.2")), "-c", INTERMEDIATE, watch],
                                  env=base_env(), stdout=subprocess.PIPE, text=True)
    child_pid = int(supervisor.stdout.readline())
    child = psutil.Process(child_pid)
    try:
        assert supervisor.stdout.readline().strip() == "imported"  # the shim is active
        supervisor.kill()
        supervisor.wait()
        try:
            child.wait(timeout=15)
            exited = True
        except psutil.TimeoutExpired:
            exited = False
        assert exited == (watch == "on")
    finally:
        try:
            os.killpg(child_pid, 9)
        except OSError:
            pass


# -- item 15: MLX_HOTFIX_EXIT_GRACE=0 never cuts a client off -------------------------


def test_exit_grace_below_the_floor_is_raised_with_a_warning(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", "from mlx_hotfix import config, log\n"
         "c = config.current()\n[log.say(w) for w in c.warnings]\nprint(c.exit_grace)"],
        env=base_env(extra={"MLX_HOTFIX_EXIT_GRACE": "0"}), capture_output=True, text=True,
        timeout=60)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout) == 2.0
    assert "MLX_HOTFIX_EXIT_GRACE=0 is below" in result.stderr


@pytest.mark.server
def test_exit_grace_zero_still_answers_every_stream(servers, tiny_llama, tmp_path):
    from tests.conftest import fault_env
    from harness.server import BackgroundRequest, sse_events

    arm = tmp_path / "arm"
    env = fault_env("raise:typeerror:decode:2", arm)
    env["MLX_HOTFIX_EXIT_GRACE"] = "0"
    server = servers("0.32.2", tiny_llama, env=env)
    server.warm_up()
    streams = [
        BackgroundRequest(lambda i=i: server.chat("story %d " % i * 20, max_tokens=4000,
                                                  stream=True, timeout=60), name="s%d" % i)
        for i in range(16)
    ]
    # Every stream in flight before the fault is armed: a client that had not
    # even connected when the process exited would be refused, not cut off.
    deadline = time.monotonic() + 60
    while requests.get(server.url + "/health", timeout=10).json().get("in_flight", 0) < 16:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)
    arm.touch()
    assert server.wait_exit(60) == 70, server.log()
    for stream in streams:
        assert stream.join(70), stream
        assert stream.error is None, stream
        events = sse_events(stream.body)
        if stream.status == 200:
            assert events and (events[-1] == "[DONE]" or (
                isinstance(events[-1], dict) and "error" in events[-1])), (stream, events[-3:])
        else:
            assert stream.status == 503, stream
