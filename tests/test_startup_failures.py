"""A server that cannot start, under `supervise` (the real CLI, the real stock
server with the shim): install's checks refuse a missing model path and a
taken port before the first start; a start-up death is named by the shim's
own one-line cause (left in the heartbeat's `death` field), and the same
death again and again adds to one crash report's `repeats` instead of
flooding the folder (50 of them would evict the reports that matter).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from harness.server import base_env, free_port, python_for
from harness.watchdog_run import WatchdogProcess

pytestmark = pytest.mark.server

DEATHS = 4  # start-up deaths to watch before counting reports


def _server(model: str, port: int) -> list:
    return [str(python_for("0.32.2")), "-m", "mlx_lm", "server", "--model", model,
            "--host", "127.0.0.1", "--port", str(port)]


def _supervise(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlx_watchdog", "supervise", *args],
                          env=base_env(shim=False), capture_output=True, text=True, timeout=120)


def test_supervise_refuses_a_missing_model_path_and_a_taken_port(tmp_path):
    missing = tmp_path / "no-such-model"
    result = _supervise(tmp_path, "--", *_server(str(missing), free_port()))
    assert result.returncode == 1
    assert f"cannot start the server: --model '{missing}': no such file or directory" \
        in result.stderr, result.stderr
    assert "spawned" not in result.stderr  # nothing was started
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        model = tmp_path / "model"
        model.mkdir()
        result = _supervise(tmp_path, "--", *_server(str(model), port))
    assert result.returncode == 1
    assert f"cannot start the server: --port {port} is already in use on 127.0.0.1" \
        in result.stderr, result.stderr


def _reports(folder: Path) -> list:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def _loop(tmp_path: Path, *args: str) -> tuple:
    """supervise a server that dies at every start, until DEATHS exits; its
    exit events and the reports written meanwhile."""
    reports = tmp_path / "reports"
    sup = WatchdogProcess(tmp_path, ["supervise", "--name", "qwen", "--backoff-max", "1",
                                     "--report-dir", str(reports), *args],
                          env=base_env(shim=False))
    try:
        sup.wait_for(lambda: len([e for e in sup.events() if e["event"] == "exited"]) >= DEATHS,
                     300, f"{DEATHS} start-up deaths")
        exits = [e for e in sup.events() if e["event"] == "exited"]
        found = _reports(reports)
    finally:
        sup.cleanup()
    return exits, found, sup


def test_a_model_that_cannot_load_is_named_and_counted_on_one_report(tmp_path):
    empty = tmp_path / "not-a-model"
    empty.mkdir()  # exists (the check passes), but the load fails at every start
    port = free_port()
    exits, found, sup = _loop(tmp_path, "--", *_server(str(empty), port))
    cause = f"FileNotFoundError: [Errno 2] No such file or directory: '{empty}/config.json'"
    for event in exits:
        assert event["message"] == f"server exited with code 70 at start-up: {cause}", event
        assert "saw the generation thread die" not in event["message"]
        assert event["death_cause"] == "config-model-path", event  # a configuration class
    (report,) = found  # one report, however many deaths
    assert report["cause"] == "config-model-path" and "fix --model" in report["remedy"]
    assert report["repeats"] >= len(exits) >= DEATHS, report.get("repeats")
    assert report["during_startup"] is True and report["kind"] == "died"
    assert report["instance"] == {"name": "qwen", "port": port, "model": str(empty)}
    status = [e for e in sup.events() if e["event"] == "restart"]
    assert status and cause in status[-1]["message"]


def test_a_taken_port_is_named_and_counted_on_one_report(tmp_path, tiny_llama):
    with socket.socket() as taken:  # another process's listener on the port
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # --no-listener-check skips the port check (the port may be a proxy's);
        # --no-socket: each child binds the port itself (a held socket could
        # not be bound either, and supervise would refuse to start).
        exits, found, _ = _loop(tmp_path, "--no-listener-check", "--no-socket", "--",
                                *_server(str(tiny_llama), port))
    for event in exits:
        assert event["message"] == ("server exited with code 70 at start-up: OSError: "
                                    "[Errno 98] Address already in use"), event
    (report,) = found
    assert report["repeats"] >= len(exits) >= DEATHS
    assert report["exception"]["type"] == "builtins.OSError"
    assert report["instance"]["port"] == port
