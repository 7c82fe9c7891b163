"""A rolling restart behind monitoring/haproxy.cfg loses no request.

Two supervised real servers (stock 0.31.3 and 0.32.2, each with the shim)
behind the shipped HAProxy config, under a steady load of two clients; each
server is restarted in turn with `mlx-watchdog restart NAME` and the next
one only once HAProxy has it UP again. docs/operator.md ("Running several
Macs") gives the same procedure. Both ways a server may hold its port:

- `--no-socket` (what the guide advises behind a balancer): the draining
  server answers /health 503 "draining" and new requests 503 until HAProxy
  has stopped sending to it (the drain's quiet period, MLX_HOTFIX_DRAIN_QUIET:
  its port never closes under a request HAProxy sent), and HAProxy retries
  those 503s on the other server (`retry-on ... 503`; `option
  http-buffer-request`, so that it has each whole request to retry), as it
  does the refused connections while the server reloads;
- the held socket (supervise's default): the draining server takes no new
  connection; HAProxy's check times out, and what it sent meanwhile waits in
  the socket for the next server.

One client streams: a stream cannot be retried once its 200 went out, so
only the drain (which lets it finish) keeps it whole.
"""

from __future__ import annotations

import subprocess
import sys
from typing import List

import pytest

from harness.haproxy import ClientLoop, HAProxy, StreamedAnswer
from harness.procs import chat
from harness.server import VERSIONS, base_env, free_port
from harness.watchdog_run import WatchdogProcess, wait_serving
from tests.test_supervise_socket import FAST, LOAD_S, server_command, wait_ok_after

pytestmark = pytest.mark.server


@pytest.fixture
def running(tmp_path):
    started: list = []
    yield started
    for thing in reversed(started):
        if isinstance(thing, WatchdogProcess):
            thing.cleanup()
        elif isinstance(thing, ClientLoop):
            thing.stop()
        else:
            thing.stop()


@pytest.mark.parametrize("socket_flag", ["--no-socket", "--socket"])
def test_rolling_restart_behind_haproxy_loses_no_request(running, tiny_llama, tmp_path,
                                                        socket_flag):
    supervisors: List[WatchdogProcess] = []
    urls = {}
    for index, version in enumerate(VERSIONS):
        name, port = f"mac{index + 1}", free_port()
        env = base_env(shim=False, extra={"MLX_HOTFIX_REPORT_DIR": str(tmp_path / name)})
        sup = WatchdogProcess(tmp_path, ["supervise", "--name", name, socket_flag, *FAST, "--",
                                         *server_command(version, tiny_llama, port)],
                              name=name, env=env)
        running.append(sup)
        supervisors.append(sup)
        urls[name] = f"http://127.0.0.1:{port}"
    for sup, url in zip(supervisors, urls.values()):
        wait_serving(url, LOAD_S, log=sup)
    proxy = HAProxy(tmp_path, urls)
    running.append(proxy)
    for name in urls:
        proxy.wait_status(name, "UP")
    loop = ClientLoop(proxy.url, workers=2, timeout=LOAD_S, send=lambda: chat(
        proxy.url, "tell me a story", max_tokens=30, timeout=LOAD_S))
    streams = ClientLoop(proxy.url, workers=1, timeout=LOAD_S, send=lambda: StreamedAnswer(
        proxy.url, timeout=LOAD_S))
    running += [loop, streams]
    loop.wait_count(lambda o: o.ok, 4, timeout=LOAD_S)
    streams.wait_count(lambda o: o.ok, 2, timeout=LOAD_S)

    for sup, name in zip(supervisors, urls):
        done = subprocess.run([sys.executable, "-m", "mlx_watchdog", "restart", name,
                               "--state-file", str(sup.state_path), "--timeout", str(LOAD_S)],
                              capture_output=True, text=True, timeout=LOAD_S + 30)
        assert done.returncode == 0, done.stdout + done.stderr + sup.tail()
        proxy.wait_status(name, "UP", timeout=LOAD_S)  # then the next one
        wait_ok_after(loop, len(loop.outcomes), 2)
        wait_ok_after(streams, len(streams.outcomes), 1)
    loop.stop(timeout=LOAD_S)
    streams.stop(timeout=LOAD_S)

    outcomes = list(loop.outcomes) + list(streams.outcomes)
    failed = [o for o in outcomes if not o.ok]
    assert not failed, (failed, proxy.log()[-3000:])
    assert {o.server for o in outcomes} == set(urls)  # both served
    for sup in supervisors:
        planned = [e for e in sup.events() if e["event"] == "restart"
                   and e.get("cause") == "planned"]
        assert len(planned) == 1, sup.tail()
