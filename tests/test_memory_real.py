"""The memory guard on real shimmed stock servers under `supervise
--memory-limit`, with a client sending one request after another:

- a server that leaks per request (harness fault MLX_TEST_LEAK_BYTES) gets
  its soft trim (the shim says it trimmed), then a planned, drained restart
  (cause memory) before the limit, with no failed request, and a `memory`
  report with its samples that `mlx-watchdog reports` lists;
- a healthy server under the same limit and load is never restarted;
- a slow leak under a short --memory-horizon is restarted on the trend,
  before it even reaches the soft line.

The limit is set from the server's own size, read from the same harness
server's heartbeat, so it holds on any machine. No timing assertions.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.haproxy import ClientLoop
from harness.procs import chat
from harness.server import base_env, free_port
from harness.watchdog_run import WatchdogProcess, wait_serving
from tests.conftest import FAULTS_DIR
from tests.test_supervise_socket import server_command, supervisors  # noqa: F401

pytestmark = pytest.mark.server

LOAD_S = 240
MiB = 1 << 20
FAST = ["--probe-interval", "1", "--probe-timeout", "30", "--failures", "3",
        "--boot-grace", "120", "--heartbeat-timeout", "20", "--stop-grace", "30"]
# The leak's server: its size at rest plus this much is the limit, so the
# soft line (85%) and the hard line (95%) are a few dozen requests away.
HEADROOM = 640 * MiB


def leak_env(tmp_path: Path, leak_bytes: int = 0) -> dict:
    env = {"MLX_HOTFIX_REPORT_DIR": str(tmp_path / "reports")}
    if leak_bytes:
        env["PYTHONPATH"] = str(FAULTS_DIR)  # after the shim's folder: it chains into it
        env["MLX_TEST_LEAK_BYTES"] = str(leak_bytes)
    return env


@pytest.fixture(scope="module")
def at_rest_bytes(tiny_llama, tmp_path_factory) -> int:
    """The RSS of a shimmed tiny server at rest after a few requests, from
    a first short run (the limits depend on it); once for the module."""
    tmp_path = tmp_path_factory.mktemp("at-rest")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    sup = WatchdogProcess(tmp_path, ["supervise", "--name", "size", *FAST, "--memory-limit",
                                     "off", "--", *server_command("0.32.2", tiny_llama, port)],
                          name="size", env=dict(base_env(shim=False), **leak_env(tmp_path)))
    try:
        wait_serving(url, LOAD_S, log=sup)
        for _ in range(5):
            assert chat(url, "tell me a story", max_tokens=20, timeout=LOAD_S).status_code == 200
        import psutil

        child = psutil.Process(sup.current_child())
        return sum(p.memory_info().rss for p in [child] + child.children(recursive=True))
    finally:
        sup.cleanup()


def guarded(supervisors, name: str, tiny_llama, limit: int, env: dict, *flags: str):
    """`supervise --memory-limit LIMIT` of a real shimmed server; (process, url)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    sup = supervisors(name, ["supervise", "--name", name, *FAST, "--memory-limit", str(limit),
                             "--memory-idle-wait", "30s", *flags, "--",
                             *server_command("0.32.2", tiny_llama, port)], env)
    wait_serving(url, LOAD_S, log=sup)
    return sup, url


def paced_client(url: str, pause_s: float) -> ClientLoop:
    """One request after another, a short pause between (a person at a chat)."""
    def send():
        time.sleep(pause_s)
        return chat(url, "tell me a story", max_tokens=20, timeout=LOAD_S)

    return ClientLoop(url, workers=1, timeout=LOAD_S, send=send)


def memory_restarts(sup: WatchdogProcess) -> list:
    return [e for e in sup.events() if e["event"] == "restart" and e.get("cause") == "memory"]


def failures(loop: ClientLoop) -> list:
    return [o for o in list(loop.outcomes) if not o.ok]


def test_a_leaking_server_is_trimmed_then_restarted_drained_before_the_limit(
        supervisors, tiny_llama, tmp_path, at_rest_bytes):
    limit = at_rest_bytes + HEADROOM
    sup, url = guarded(supervisors, "leak", tiny_llama, limit, leak_env(tmp_path, 16 * MiB))
    loop = paced_client(url, 0.3)
    try:
        sup.wait_for(lambda: memory_restarts(sup), LOAD_S, "a memory restart")
        restarted_at = len(loop.outcomes)
        deadline = time.monotonic() + LOAD_S
        while len([o for o in list(loop.outcomes)[restarted_at:] if o.ok]) < 3:
            assert time.monotonic() < deadline, sup.tail()
            time.sleep(0.1)
    finally:
        loop.stop(timeout=LOAD_S)
    assert not failures(loop), failures(loop)
    events = sup.events()
    names = [e["event"] for e in events]
    assert "memory_soft" in names, sup.tail()
    assert names.index("memory_soft") < names.index("restart")
    assert "memory: trimmed on request 1" in sup.text()  # the shim served the trim
    [restart] = memory_restarts(sup)
    assert restart["message"].startswith("planned restart: memory: ")
    assert not [e for e in events if e["event"] == "restart" and e.get("cause") != "memory"]
    # Drained, not killed: no stacks were taken, the child ended on SIGTERM.
    assert not [e for e in events if e.get("kind") == "wedged"]
    reports = sorted((tmp_path / "reports").glob("*-memory-*.json"))
    assert len(reports) == 1, list((tmp_path / "reports").iterdir())
    report = json.loads(reports[0].read_text())
    assert report["kind"] == "memory" and report["cause"] == "memory"
    assert report["trigger"] in ("hard", "trend")
    samples = [s["bytes"] for s in report["samples"]]
    assert len(samples) >= 5 and max(samples) < limit  # before the limit itself
    assert samples[-1] >= report["soft_line_bytes"]
    listing = subprocess.run(
        [sys.executable, "-m", "mlx_watchdog", "reports", "--dir",
         str(tmp_path / "reports")], capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0 and "memory" in listing.stdout, listing
    record = sup.record("leak")
    assert record["memory"]["restarts"] == 1 and record["memory"]["limit_bytes"] == limit
    assert sup.terminate() == 0


def test_a_healthy_server_under_the_same_limit_and_load_is_never_restarted(
        supervisors, tiny_llama, tmp_path, at_rest_bytes):
    limit = at_rest_bytes + HEADROOM
    sup, url = guarded(supervisors, "healthy", tiny_llama, limit, leak_env(tmp_path))
    loop = paced_client(url, 0.3)
    try:
        # As many requests as took the leaking server past its limit, and more.
        loop.wait_count(lambda o: o.ok, 80, LOAD_S * 2)
    finally:
        loop.stop(timeout=LOAD_S)
    assert not failures(loop), failures(loop)
    events = sup.events()
    assert not [e for e in events if e["event"] in ("restart", "memory_soft")], sup.tail()
    record = sup.record("healthy")
    assert record["restarts"] == 0 and record["memory"]["state"] == "ok"
    assert 0 < record["memory"]["bytes"] < 0.85 * limit
    assert sup.terminate() == 0


def test_a_slow_leak_is_restarted_on_the_trend_before_the_soft_line(
        supervisors, tiny_llama, tmp_path, at_rest_bytes):
    limit = at_rest_bytes + 4 * HEADROOM
    sup, url = guarded(supervisors, "trend", tiny_llama, limit, leak_env(tmp_path, 4 * MiB),
                       "--memory-horizon", "2m")
    loop = paced_client(url, 0.2)
    try:
        sup.wait_for(lambda: memory_restarts(sup), LOAD_S * 2, "a memory restart on the trend")
    finally:
        loop.stop(timeout=LOAD_S)
    assert not failures(loop), failures(loop)
    [report] = [json.loads(p.read_text())
                for p in sorted((tmp_path / "reports").glob("*-memory-*.json"))]
    assert report["trigger"] == "trend", report["reason"]
    assert report["eta_s"] <= 120
    assert max(s["bytes"] for s in report["samples"]) < report["soft_line_bytes"]
    assert "memory_soft" not in [e["event"] for e in sup.events()]
    assert sup.terminate() == 0
