"""The watchdog's probe (header X-MLX-Watchdog-Probe: 1) against real stock
servers: with the heartbeat part it leaves no line in the server's log and
adds nothing to the throughput counters; with the part off (stock logging)
every probe adds its access line and prompt lines, which is the log flood
the header exists for. A client's request is logged and counted as before.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from harness.server import StockServer
from mlx_watchdog.probe import Probe

pytestmark = pytest.mark.server

PROBES = 3


def _counters(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: record.get(k) for k in ("requests", "decode_tokens", "prompt_tokens", "delivered")}


def _wait(condition, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def _new_lines(server: StockServer, mark: int) -> list:
    return [line for line in server.log()[mark:].splitlines() if line.strip()]


def test_a_probe_stays_out_of_the_server_log_and_counters(servers, tiny_llama, tmp_path):
    started = {}
    for label, version, disable in (("0.31.3", "0.31.3", ""), ("0.32.2", "0.32.2", ""),
                                    ("stock-logging", "0.32.2", "heartbeat")):
        beat = tmp_path / f"{label}.heartbeat"
        env = {"MLX_HOTFIX_HEARTBEAT_FILE": str(beat), "MLX_HOTFIX_DISABLE": disable}
        started[label] = (servers(version, tiny_llama, env=env), beat)
    for label, (server, beat) in started.items():
        server.warm_up()
        if label != "stock-logging":
            _wait(lambda b=beat: (_counters(b).get("requests") or 0) >= 1, "the warm-up counted")

    for label, (server, beat) in started.items():
        mark, before = len(server.log()), _counters(beat)
        for _ in range(PROBES):
            result = Probe(server.url, timeout=60)()
            assert result.ok, result
        probe_lines = _new_lines(server, mark)
        if label == "stock-logging":
            # Without the part: every probe logs, as stock does.
            posts = [line for line in probe_lines if "POST /v1/chat/completions" in line]
            assert len(posts) == PROBES, probe_lines
            continue
        assert probe_lines == [], probe_lines
        # A client's request is logged and counted as always; by the time the
        # heartbeat shows it, it would show the probes too.
        mark = len(server.log())
        response = server.chat("count me", max_tokens=3)
        assert response.status_code == 200
        tokens = response.json()["usage"]["completion_tokens"]
        after = _wait(lambda b=beat, n=before["requests"] + 1: (c := _counters(b)).get("requests") == n
                      and c, "the client's request in the heartbeat")
        assert after["decode_tokens"] == before["decode_tokens"] + tokens, (before, after)
        assert any("POST /v1/chat/completions" in line for line in _new_lines(server, mark))
