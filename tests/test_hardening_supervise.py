"""supervise never leaves an orphan (issue 9, item 3): SIGHUP and SIGQUIT stop
it like SIGTERM, its child dies with it even when it is SIGKILLed, and a child
that exits takes its process group with it."""

from __future__ import annotations

import os
import signal
import sys

import psutil
import pytest

from mlx_watchdog.policy import RestartPolicy
from mlx_watchdog.config import InstanceConfig, RestartConfig
from mlx_watchdog.judge import HEALTHY
from mlx_watchdog.supervise import Supervisor
from tests.test_supervise import GOOD, gone, real_supervisor, wait_for  # noqa: F401


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGQUIT])
def test_sighup_and_sigquit_stop_the_child_like_sigterm(real_supervisor, sig):
    sup = real_supervisor("ok")
    wait_for(lambda: sup.record().get("state") == HEALTHY, 30, "a healthy child", sup.log)
    [child] = sup.child_pids()
    sup.proc.send_signal(sig)
    assert sup.proc.wait(timeout=30) == 0
    wait_for(lambda: gone(child), 10, "the child to be gone", sup.log)
    assert "SIGTERM to pid" in sup.log.read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_sigkilled_supervisor_takes_its_child_with_it(real_supervisor):
    sup = real_supervisor("ok")
    wait_for(lambda: sup.record().get("state") == HEALTHY, 30, "a healthy child", sup.log)
    [child] = sup.child_pids()
    sup.proc.kill()
    sup.proc.wait()
    wait_for(lambda: gone(child), 15, "the orphan to be gone", sup.log)


def test_a_child_that_exits_takes_its_group_with_it(tmp_path):
    grandchild_file = tmp_path / "grandchild"
    script = f"sleep 300 & echo $! > {grandchild_file}; exit 3"
    supervisor = Supervisor(
        ["sh", "-c", script],
        InstanceConfig("test", "http://127.0.0.1:8080", RestartConfig("none"), failures=2,
                       stop_grace=3),
        probe=lambda: GOOD,
        policy=RestartPolicy(boot_grace_s=0, backoff_initial_s=60, max_restarts=1,
                             window_s=300),
    )
    supervisor.start()
    first = supervisor.child
    try:
        first.popen.wait(timeout=30)
        grandchild = int(grandchild_file.read_text())
        assert psutil.pid_exists(grandchild)
        supervisor.tick()
        wait_for(lambda: gone(grandchild), 10, "the grandchild to be gone", tmp_path / "x")
    finally:
        supervisor.shutdown()
        try:
            os.killpg(first.pid, signal.SIGKILL)
        except OSError:
            pass
