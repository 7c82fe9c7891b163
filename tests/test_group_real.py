"""A real 2-rank `mlx.launch --backend ring` group of the stock mlx_lm.server
(tiny model, this host), supervised as one: a death or a hang on rank 1
restarts the whole group, the client is answered, and nothing of the old
group is left. Then the same group through the definition `install`
generates, run the way test_install_e2e.py runs them.

Faults strike rank 1 only (MLX_TEST_FAULT_RANK=1). No timing assertions.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import psutil
import pytest

from tests.conftest import fault_env
from harness.server import BackgroundRequest, base_env, free_port, python_for
from harness.procs import chat
from harness.watchdog_run import WatchdogProcess, is_gone, wait_serving

pytestmark = pytest.mark.server

FAST = ["--probe-interval", "1", "--probe-timeout", "2", "--failures", "3",
        "--boot-grace", "60", "--heartbeat-timeout", "3", "--stop-grace", "3"]
LOAD_S = 240  # two ranks load on a shared 2-core machine


def group_command(version: str, model: Path, port: int, launch: List[str]) -> List[str]:
    python = python_for(version)
    return [str(python.parent / "mlx.launch"), *launch, "--backend", "ring", "--",
            str(python), "-m", "mlx_lm", "server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port)]


def group_pids(root: int) -> List[int]:
    try:
        proc = psutil.Process(root)
        return [root] + [c.pid for c in proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def all_gone(pids: List[int]) -> bool:
    return all(is_gone(pid) for pid in pids)


@pytest.fixture
def watchdogs(tmp_path):
    started: List[WatchdogProcess] = []

    def start(args, *, env=None) -> WatchdogProcess:
        environment = base_env(shim=False)
        environment.update(env or {})
        proc = WatchdogProcess(tmp_path, args, name=f"sup-{len(started)}", env=environment)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.cleanup()


def strike(sup: WatchdogProcess, arm: Path, url: str) -> BackgroundRequest:
    arm.touch()
    request = BackgroundRequest(lambda: chat(url, "tell me a story", max_tokens=20, timeout=90),
                                name="struck")
    sup.wait_for(lambda: "mlx-test-fault: " in sup.text(), 90, "the fault to strike rank 1")
    arm.unlink()
    return request


@pytest.mark.parametrize("fault,cause", [("raise:typeerror:decode", "exited"),
                                         ("hang:decode", "heartbeat-stale")])
def test_a_death_or_hang_on_rank_1_restarts_the_whole_group(watchdogs, tiny_llama, tmp_path,
                                                             fault, cause):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    arm = tmp_path / "arm"
    env = {**fault_env(fault, arm, shim=False), "MLX_TEST_FAULT_RANK": "1"}
    sup = watchdogs(["supervise", *FAST, "--",
                     *group_command("0.32.2", tiny_llama, port, ["-n", "2"])], env=env)
    wait_serving(url, LOAD_S, log=sup)
    launcher = sup.current_child()
    old = group_pids(launcher)
    assert len(old) >= 3, old  # the launcher and two ranks

    request = strike(sup, arm, url)
    restart = sup.wait_event(lambda e: e["event"] == "restart", 120, "a restart")
    assert restart["cause"] == cause, restart
    # The client is answered (503 from the shim on rank 0 for a death; for a
    # hang its connection ends with the group): it is not left waiting.
    assert request.join(120), "the client was left waiting"
    if cause == "exited":
        assert request.status == 503, request
    wait_serving(url, LOAD_S, log=sup)
    sup.wait_for(lambda: all_gone(old), 60, "every process of the old group to be gone")
    assert sup.current_child() != launcher
    assert sup.terminate() == 0
    assert all_gone(group_pids(launcher))


def test_each_local_rank_writes_its_own_heartbeat_naming_rank_and_host(watchdogs, tiny_llama,
                                                                       tmp_path):
    import json

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    sup = watchdogs(["supervise", *FAST, "--",
                     *group_command("0.32.2", tiny_llama, port, ["-n", "2"])])
    wait_serving(url, LOAD_S, log=sup)
    ranks = [p for p in group_pids(sup.current_child())
             if "mlx.launch" not in " ".join(psutil.Process(p).cmdline())]
    files = set()
    for pid in ranks:
        environ = dict(line.split("=", 1) for line in
                       Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in line)
        base = environ["MLX_HOTFIX_HEARTBEAT_FILE"]
        rank = int(environ["MLX_RANK"])
        path = base if rank == 0 else f"{base}.rank{rank}"
        record = json.loads(Path(path).read_text())
        assert record["rank"] == rank and record["host"] == os.uname().nodename
        assert record["pid"] == pid
        files.add(path)
    assert len(files) == 2
    assert sup.terminate() == 0


# -- through the definitions install generates -------------------------------------------


def _install_group(tmp_path: Path, manager: str, version: str, model: Path, port: int,
                   hostfile: Path) -> tuple:
    out = tmp_path / "out"
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
           "XDG_STATE_HOME": str(home / ".local" / "state")}
    result = subprocess.run(
        [sys.executable, "-m", "mlx_watchdog", "install", manager, "--dry-run",
         "--output-dir", str(out), "--model", str(model), "--python", str(python_for(version)),
         "--port", str(port), "--offline", "--hostfile", str(hostfile), "--backend", "ring"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    from tests.test_install_e2e import _launchd_server, _systemd_server

    return (_launchd_server if manager == "launchd" else _systemd_server)(out)


@pytest.mark.parametrize("manager", ["systemd", "launchd"])
def test_the_installed_group_fails_loudly_after_a_rank_death_and_serves_again(
        tiny_llama, tmp_path, manager):
    port = free_port()
    hostfile = tmp_path / "hosts.json"
    # One local host named twice (once by name): both ranks run here.
    hostfile.write_text('[{"ssh": "localhost", "ips": ["127.0.0.1"]},'
                        ' {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}]')
    argv, definition_env = _install_group(tmp_path, manager, "0.32.2", tiny_llama, port,
                                          hostfile)
    assert argv[argv.index("exec") + 1:][1].endswith("mlx.launch"), argv
    arm = tmp_path / "arm"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home"), **definition_env}
    faults = fault_env("raise:typeerror:decode", arm)
    env.update({**faults, "PYTHONPATH": definition_env["PYTHONPATH"] + os.pathsep
                + faults["PYTHONPATH"].split(os.pathsep)[-1], "MLX_TEST_FAULT_RANK": "1"})
    url = f"http://127.0.0.1:{port}"
    for attempt in range(2):  # the service manager runs it again after a failure
        log_path = tmp_path / f"server-{attempt}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            wait_serving(url, LOAD_S)
            members = group_pids(proc.pid)
            assert len(members) >= 4, members  # exec, launcher, two ranks
            if attempt == 1:
                proc.terminate()  # what systemctl stop / launchctl bootout do
                assert proc.wait(60) == 0
                assert all_gone(members)
                break
            arm.touch()
            request = BackgroundRequest(lambda: chat(url, "hello", max_tokens=20, timeout=90))
            assert request.join(120) and request.status == 503, request
            arm.unlink()
            # Upstream mlx.launch exits 0 here; the definition exits 70: restarted.
            assert proc.wait(60) == 70, log_path.read_text()
            deadline = time.monotonic() + 60
            while not all_gone(members):
                assert time.monotonic() < deadline, "a process of the old group is left"
                time.sleep(0.2)
            assert "Node with rank" in log_path.read_text()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
