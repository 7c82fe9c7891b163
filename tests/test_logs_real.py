"""What an operator reads: the real `supervise` (text log, as in a terminal
or the journal) over a real shimmed stock server. The first line names the
whole command; the server's own lines carry a [server] prefix; no line says
a thing twice; the watchdog's probes leave nothing in the server's output,
while a client's request is logged as always."""

from __future__ import annotations

import re
import shlex

import pytest

from harness.server import base_env, free_port, python_for
from harness.watchdog_run import WatchdogProcess, wait_serving

pytestmark = pytest.mark.server


def test_supervise_log_reads_well(tmp_path, tiny_llama):
    port = free_port()
    command = [str(python_for("0.32.2")), "-m", "mlx_lm", "server", "--model", str(tiny_llama),
               "--host", "127.0.0.1", "--port", str(port)]
    sup = WatchdogProcess(tmp_path, ["supervise", "--probe-interval", "0.5", "--", *command],
                          env=base_env(shim=False), log_format=False)
    try:
        url = f"http://127.0.0.1:{port}"
        sup.wait_for(lambda: "state: healthy" in sup.text(), 180, "healthy")
        # Probes go on every 0.5 s meanwhile; then one client request.
        wait_serving(url, 60, log=sup)
        sup.wait_for(lambda: "POST /v1/chat/completions" in sup.text(), 30, "the client's line")
        lines = sup.text().splitlines()
        first = lines[0]
        assert re.search(r"INFO +\[127\.0\.0\.1:\d+\] supervise: supervising `", first), first
        assert f"`{shlex.join(command)}`, probing {url}" in first, first
        server_lines = [line for line in lines if line.startswith("[server] ")]
        assert any(line.startswith("[server] mlx-hotfix: mlx-lm 0.32.2") for line in server_lines)
        watchdog_lines = [line for line in lines if not line.startswith("[server] ")]
        assert all(re.match(r"\d{4}-\d\d-\d\dT", line) for line in watchdog_lines), watchdog_lines
        for line in watchdog_lines:
            for key, value in re.findall(r' (\w+)=("[^"]*"|\S+)', line):
                shown = value.strip('"')
                assert not re.search(rf"\b{re.escape(shown)}\b", line.split(f" {key}=")[0]), line
        posts = [line for line in server_lines if "POST /v1/chat/completions" in line]
        assert len(posts) == 1, posts  # the client's; none of the probes'
    finally:
        sup.cleanup()
