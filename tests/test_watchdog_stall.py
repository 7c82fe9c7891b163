"""The watchdog against the real stock server for the hangs a loop pulse misses:
a livelock (the loop turns, nothing is delivered: upstream #1493) and a hang
on the first real request after start-up (before any probe ever succeeded).

Outcomes only, with generous bounded waits (no timing assertions).
"""

from __future__ import annotations

import pytest

from tests.conftest import fault_env
from harness.server import free_port
from harness.watchdog_run import is_gone, wait_serving
from tests.test_watchdog_real import (  # noqa: F401 - watchdogs is a fixture
    FAST,
    LOAD_S,
    assert_never_crashed,
    hung_request,
    server_command,
    strike,
    watchdogs,
)

pytestmark = pytest.mark.server


def test_a_livelock_is_restarted_for_its_stalled_heartbeat(watchdogs, tiny_llama, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    arm = tmp_path / "arm"
    env = fault_env("livelock:batch", arm, shim=False)  # supervise adds the shim itself
    env["MLX_HOTFIX_STALL_TIMEOUT"] = "10"
    sup = watchdogs(["supervise", *FAST, "--", *server_command("0.31.3", tiny_llama, port)],
                    env=env)
    wait_serving(url, LOAD_S, log=sup)
    first = sup.current_child()
    sup.wait_event(lambda e: e.get("state") == "healthy", 60, "a healthy probe")

    strike(sup, arm, lambda: hung_request(url))
    # The loop keeps turning (the heartbeat stays fresh): only deliveries tell.
    restart = sup.wait_event(lambda e: e["event"] == "restart", 120, "a restart")
    assert restart["cause"] == "stalled", restart
    wait_serving(url, LOAD_S, log=sup)
    sup.wait_for(lambda: is_gone(first), 30, "the livelocked child to be gone")
    assert sup.current_child() != first and sup.record()["restarts"] == 1
    assert_never_crashed(sup, child_output=True)
    assert sup.terminate() == 0


def test_a_hang_on_the_first_request_after_start_up_is_caught_without_waiting_out_the_grace(
        watchdogs, tiny_llama, tmp_path):
    # supervise defaults, but a boot grace far longer than this test waits:
    # only the heartbeat's "loaded and serving" can end it.
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    arm = tmp_path / "arm"
    arm.touch()  # the very first prefill hangs: the watchdog's own first probe
    sup = watchdogs(["supervise", "--boot-grace", "600", "--",
                     *server_command("0.32.2", tiny_llama, port)],
                    env=fault_env("hang:prefill", arm, shim=False))
    sup.wait_for(lambda: "mlx-test-fault: hang at prefill" in sup.text(), LOAD_S,
                 "the first request to hang")
    arm.unlink()  # the restarted child serves
    first = sup.current_child()
    sup.wait_event(lambda e: e["event"] == "loaded", 60, "the boot grace to end")
    restart = sup.wait_event(lambda e: e["event"] == "restart", 120, "a restart")
    assert restart["cause"] == "heartbeat-stale", restart
    wait_serving(url, LOAD_S, log=sup)
    sup.wait_for(lambda: is_gone(first), 30, "the hung child to be gone")
    assert_never_crashed(sup, child_output=True)
    assert sup.terminate() == 0
