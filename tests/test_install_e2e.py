"""End to end: the exact command line and environment of a generated server
definition, run as a process, is a shimmed stock server that serves."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from harness.definitions import read_definition
from harness.server import free_port, python_for

pytestmark = pytest.mark.server


def _install(manager: str, tmp_path: Path, python: Path, model: Path, port: int) -> Path:
    out = tmp_path / "out"
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
           "XDG_STATE_HOME": str(home / ".local" / "state")}
    result = subprocess.run(
        [sys.executable, "-m", "mlx_watchdog", "install", manager, "--dry-run",
         "--output-dir", str(out), "--model", str(model), "--python", str(python),
         "--port", str(port), "--offline"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def _launchd_server(out: Path):
    (plist_path,) = [p for p in out.glob("*.plist") if p.name.endswith(".server.plist")]
    return read_definition(plist_path)


def _systemd_server(out: Path):
    (unit,) = out.glob("*-server.service")
    return read_definition(unit)


def _serve(argv, definition_env, tmp_path: Path, port: int) -> str:
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home"), **definition_env}
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            body = {"model": "default_model", "max_tokens": 3,
                    "messages": [{"role": "user", "content": "hello"}]}
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, log_path.read_text()
                try:
                    response = requests.post(url, json=body, timeout=60)
                    break
                except requests.ConnectionError:
                    assert time.monotonic() < deadline, log_path.read_text()
                    time.sleep(0.2)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 3
        finally:
            proc.kill()
            proc.wait(30)
    return log_path.read_text()


@pytest.mark.parametrize("manager,version", [("launchd", "0.31.3"), ("systemd", "0.32.2")])
def test_generated_server_definition_runs_a_shimmed_server(envs, tiny_llama, tmp_path, manager,
                                                           version):
    port = free_port()
    out = _install(manager, tmp_path, python_for(version), tiny_llama, port)
    argv, env = (_launchd_server if manager == "launchd" else _systemd_server)(out)
    assert argv[:4] == [str(python_for(version)), "-m", "mlx_lm", "server"]
    assert env["HF_HUB_OFFLINE"] == "1"
    log = _serve(argv, env, tmp_path, port)
    status = [l for l in log.splitlines() if l.startswith(f"mlx-hotfix: mlx-lm {version}")]
    assert len(status) == 1 and "exit applied" in status[0], log
