"""Evidence before the restart, and never down for good: the real `mlx-watchdog
supervise` over the real stock servers with injected faults (subprocesses).
No timing assertions beyond generous bounds."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.conftest import fault_env
from harness.server import VERSIONS, free_port
from tests.test_watchdog_real import (  # noqa: F401 - the fixture
    FAST, LOAD_S, hung_request, server_command, strike, watchdogs)
from harness.watchdog_run import wait_serving

pytestmark = pytest.mark.server


def _reports(directory: Path, kind: str):
    out = []
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text())
        if data.get("kind") == kind:
            out.append(data)
    return out


@pytest.mark.parametrize("version", VERSIONS)
def test_a_hang_under_supervise_leaves_a_wedged_report_with_the_hung_frame(
        watchdogs, tiny_llama, tmp_path, version):
    port, reports = free_port(), tmp_path / "reports"
    url = f"http://127.0.0.1:{port}"
    arm = tmp_path / "arm"
    sup = watchdogs(["supervise", *FAST, "--report-dir", str(reports), "--",
                     *server_command(version, tiny_llama, port)],
                    env=fault_env("hang:decode", arm, shim=False))
    wait_serving(url, LOAD_S, log=sup)
    first = sup.current_child()
    strike(sup, arm, lambda: hung_request(url))
    sup.wait_event(lambda e: e["event"] == "restart", 120, "a restart")
    sup.wait_event(lambda e: e["event"] == "report", 60, "a report")
    [wedged] = _reports(reports, "wedged")
    assert wedged["pid"] == first and wedged["source"] == "watchdog"
    stacks = wedged["stacks_text"]
    # The generation thread, caught where the injected hang holds it.
    assert "in faulty" in stacks and "_generate" in stacks, stacks
    assert "heartbeat" in wedged and wedged["reason"]
    wait_serving(url, LOAD_S, log=sup)
    assert sup.terminate() == 0


def _times(events, name):
    return [datetime.fromisoformat(e["time"]).timestamp() for e in events if e["event"] == name]


def test_repeated_deaths_keep_being_restarted_within_the_cap(watchdogs, tiny_llama, tmp_path):
    # Every life ends at its first decode step after the load (a steady client asks).
    port, cap = free_port(), 4.0
    url = f"http://127.0.0.1:{port}"
    sup = watchdogs(["supervise", *FAST, "--backoff-max", str(cap), "--max-restarts", "3",
                     "--report-dir", str(tmp_path / "reports"), "--",
                     *server_command("0.32.2", tiny_llama, port)],
                    env=fault_env("raise:resource:decode:0", shim=False))
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and len(sup.child_pids()) < 7:
        try:
            import requests

            requests.post(f"{url}/v1/chat/completions", timeout=10, json={
                "model": "default_model", "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}]})
        except Exception:  # noqa: BLE001 - the server is down or dying: that is the point
            time.sleep(0.5)
    assert len(sup.child_pids()) >= 7, sup.tail()
    assert sup.alive()
    events = sup.events()
    exits, restarts = _times(events, "exited"), _times(events, "restarted")
    assert len(exits) >= 6 and len(restarts) >= 6
    for exited in exits:
        later = [r for r in restarts if r >= exited]
        if later:  # generous bound: the cap plus a probe interval and slack
            assert later[0] - exited <= cap + 5, (exited, later[0])
    assert any(e.get("state") == "crash-looping" for e in events)
    died = _reports(tmp_path / "reports", "died")
    assert died and all("Resource limit" in r["exception"]["message"] for r in died)
    assert sup.terminate() == 0
