"""Every file the watchdog reads that the server side can write goes through
safefile (issue 18, item 3): a FIFO planted there (by the server's user, who
owns its folder under `install --system --user-name`) is refused at once,
never waited on; a symbolic link is never followed.

Each case plants a real FIFO and runs the real reader; a thread or a
subprocess with a generous limit guards against the hang the fix removes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from harness.server import python_for
from mlx_watchdog import compose, reports
from mlx_watchdog.config import InstanceConfig, RestartConfig
from mlx_watchdog.judge import HEALTHY
from mlx_watchdog.probe import OK, ProbeResult
from mlx_watchdog.process import ProcessLocator, ProcessNotFound

GOOD = ProbeResult(OK, 0.2, tokens=1, reason="ok", http_status=200)
HANG_GUARD_S = 60


def never_blocks(call):
    """call() on a thread; its result (or exception), failing if it blocks."""
    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)  # a hang guard, not a timing assertion
    assert not thread.is_alive(), "blocked on a FIFO"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def test_a_fifo_at_the_heartbeat_path_never_blocks_a_monitor_tick(tmp_path):
    heartbeat = tmp_path / "heartbeat.json"
    os.mkfifo(heartbeat)
    instance = InstanceConfig(name="a", url="http://127.0.0.1:9", restart=RestartConfig("none"),
                              heartbeat_file=str(heartbeat),
                              report_dir=str(tmp_path / "reports"))
    monitor = compose.build_monitor(instance, action=None, probe=lambda: GOOD)
    monitor.started()
    verdict = never_blocks(monitor.tick)
    assert verdict.state == HEALTHY
    assert "is not a regular file" in (monitor.heartbeat.problem or "")


def test_the_heartbeat_record_is_read_once_per_tick_for_every_reader(tmp_path, monkeypatch):
    heartbeat = tmp_path / "heartbeat.json"
    heartbeat.write_text(json.dumps({"pid": os.getpid(), "beats": 3, "time": time.time(),
                                     "phase": "serving", "decode_tokens": 10}))
    instance = InstanceConfig(name="a", url="http://127.0.0.1:9", restart=RestartConfig("none"),
                              heartbeat_file=str(heartbeat),
                              report_dir=str(tmp_path / "reports"))
    monitor = compose.build_monitor(instance, action=None, probe=lambda: GOOD)
    reads = []
    real_open = os.open

    def counting_open(path, *args, **kwargs):
        if os.fspath(path) == str(heartbeat):
            reads.append(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", counting_open)
    monitor.tick()
    assert len(reads) == 1  # the tracker and the throughput counters share it
    assert monitor.record()["server"]["phase"] == "serving"


def test_a_fifo_at_the_heartbeat_path_gives_no_record(tmp_path):
    from mlx_watchdog.heartbeat import read_record

    os.mkfifo(tmp_path / "heartbeat.json")
    assert never_blocks(lambda: read_record(tmp_path / "heartbeat.json")) is None


def test_a_fifo_named_like_a_report_is_listed_as_unreadable(tmp_path):
    reports.write_report(tmp_path, {"kind": "died", "time": time.time(), "pid": 7})
    os.mkfifo(tmp_path / "20990101-000000-000-died-1.json")
    done = subprocess.run([sys.executable, "-m", "mlx_watchdog", "reports", "--dir",
                           str(tmp_path)], capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr
    assert "unreadable report: " in done.stdout and "a FIFO" in done.stdout
    assert "died" in done.stdout


def test_a_fifo_at_the_heartbeat_path_does_not_block_the_stacks_report(tmp_path):
    os.mkfifo(tmp_path / "heartbeat.json")
    path = never_blocks(lambda: reports.capture_stacks(
        [], reason="wedged", directory=tmp_path / "reports",
        heartbeat_file=tmp_path / "heartbeat.json", wait_s=0))
    assert path is not None and "heartbeat" not in json.loads(path.read_text())


def test_a_fifo_pidfile_is_refused(tmp_path):
    os.mkfifo(tmp_path / "server.pid")
    locator = ProcessLocator(pidfile=str(tmp_path / "server.pid"))
    with pytest.raises(ProcessNotFound, match="cannot read pidfile"):
        never_blocks(locator.find)


def test_install_with_a_fifo_hostfile_fails_at_once(tmp_path):
    hostfile = tmp_path / "hosts.json"
    os.mkfifo(hostfile)
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "model").mkdir()
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
           "XDG_STATE_HOME": str(home / ".local" / "state")}
    done = subprocess.run(
        [sys.executable, "-m", "mlx_watchdog", "install", "systemd", "--dry-run",
         "--output-dir", str(tmp_path / "out"), "--model", str(tmp_path / "model"),
         "--python", str(python_for("0.32.2")), "--port", "8080", "--offline",
         "--hostfile", str(hostfile)],
        env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode != 0
    assert "a FIFO" in done.stdout + done.stderr
