"""`status` against what a real `install` wrote, with the server and the
watchdog started exactly as their definitions say (argv and environment read
back from the generated unit or plist), under a throw-away HOME.

- status finds the installed instance (its own NAME.state.json) and exits 0;
- a watchdog stopped cleanly leaves `stopped`, a killed one `stale (watchdog
  not running)`; both exit 1, and `status --prune` forgets them;
- a server whose PYTHONPATH names a shim folder that no longer exists runs
  stock: the watchdog says once, in its log, in status and in a metric, that
  the hotfix shim is not loaded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import requests

from harness.definitions import read_definition, without_launchd
from harness.procs import kill_group
from harness.server import free_port, python_for

pytestmark = pytest.mark.server

LOAD_S = 180


class Installed:
    """One instance installed with --dry-run into a fake HOME's standard folders."""

    def __init__(self, tmp_path: Path, manager: str, model: Path, *flags: str):
        self.tmp = tmp_path
        self.manager = manager
        self.home = tmp_path / "home"
        self.home.mkdir()
        self.port = free_port()
        self.name = f"mlx-{self.port}"
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("XDG_", "MLX_HOTFIX", "PYTHONPATH", "NOTIFY_SOCKET"))}
        self.env["HOME"] = str(self.home)
        self.output = self.cli("install", manager, "--dry-run", "--model", str(model),
                               "--python", str(python_for("0.32.2")), "--port", str(self.port),
                               "--offline", "--probe-interval", "1", *flags)
        assert self.output.returncode == 0, self.output.stdout + self.output.stderr
        self.procs: List[subprocess.Popen] = []

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "mlx_watchdog", *args], env=self.env,
                              capture_output=True, text=True, timeout=120)

    def definition(self, role: str) -> Tuple[List[str], Dict[str, str]]:
        """(argv, environment) of the server's or the watchdog's definition."""
        if self.manager == "launchd":  # no launchd here to hold the Sockets entry
            return without_launchd(self.home / "Library/LaunchAgents" /
                                   f"io.github.mlx-watchdog.{self.name}.{role}.plist")
        return read_definition(self.home / ".config/systemd/user" /
                               f"{self.name}-{role}.service")

    def start(self, role: str, **override: str) -> subprocess.Popen:
        """Run a definition as its manager would: its argv, its environment."""
        argv, env = self.definition(role)
        env = {"PATH": os.environ["PATH"], "HOME": str(self.home), **env, **override}
        log = open(self.tmp / f"{role}-{len(self.procs)}.log", "wb")
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        proc.log_path = Path(log.name)
        self.procs.append(proc)
        return proc

    def status(self, *args: str) -> subprocess.CompletedProcess:
        return self.cli("status", "--no-color", *args)

    def wait_status(self, pattern: str, what: str, timeout: float = LOAD_S):
        deadline = time.monotonic() + timeout
        while True:
            result = self.status()
            if re.search(pattern, result.stdout, re.M):
                return result
            if time.monotonic() > deadline:
                logs = "\n".join(p.log_path.read_text(errors="replace")[-3000:] for p in self.procs)
                raise AssertionError(f"no {what}: {result.stdout}{result.stderr}\n{logs}")
            time.sleep(0.5)

    def cleanup(self) -> None:
        for proc in self.procs:
            kill_group(proc)


@pytest.fixture
def installs(tmp_path):
    made: List[Installed] = []

    def make(manager: str, model: Path, *flags: str) -> Installed:
        installed = Installed(tmp_path / manager, manager, model, *flags)
        made.append(installed)
        return installed

    (tmp_path / "launchd").mkdir()
    (tmp_path / "systemd").mkdir()
    yield make
    for installed in made:
        installed.cleanup()


@pytest.mark.parametrize("manager", ["systemd", "launchd"])
def test_status_sees_an_installed_instance_and_its_watchdog_stopping_or_dying(
        installs, tiny_llama, manager):
    inst = installs(manager, tiny_llama)
    assert "check it: mlx-watchdog status" in inst.output.stdout
    inst.start("server")
    watchdog = inst.start("watchdog")
    healthy = inst.wait_status(rf"^{inst.name} +healthy ", "healthy row")
    assert healthy.returncode == 0, healthy.stdout
    state_file = json.loads(inst.status("--json").stdout)["files"]
    assert [Path(f).name for f in state_file] == [f"{inst.name}.state.json"]

    # A clean stop (what systemctl stop / launchctl bootout send): stopped, exit 1.
    watchdog.send_signal(signal.SIGTERM)
    assert watchdog.wait(60) == 0
    stopped = inst.status()
    assert re.search(rf"^{inst.name} +stopped ", stopped.stdout, re.M), stopped.stdout
    assert stopped.returncode == 1

    # Started again, then killed: the row must not stay healthy.
    watchdog = inst.start("watchdog")
    inst.wait_status(rf"^{inst.name} +healthy ", "healthy again")
    watchdog.kill()
    watchdog.wait(30)
    stale = inst.status()
    assert re.search(rf"^{inst.name} +stale \(watchdog not running\) ", stale.stdout, re.M), \
        stale.stdout
    assert f"(pid {watchdog.pid}) is not running" in stale.stdout
    assert stale.returncode == 1

    pruned = inst.status("--prune")
    assert f"forgot {inst.name}" in pruned.stderr
    assert inst.name not in pruned.stdout and pruned.returncode == 1


def test_a_server_without_the_shim_is_flagged_in_log_status_and_metrics(installs, tiny_llama):
    metrics_port = free_port()
    inst = installs("systemd", tiny_llama, "--metrics-port", str(metrics_port))
    gone = inst.tmp / "rebuilt-venv-gone" / "dropin"  # the unit's shim folder vanished
    inst.start("server", PYTHONPATH=str(gone))
    watchdog = inst.start("watchdog")
    message = ("the hotfix shim is not loaded (check PYTHONPATH); exit on death and stall "
               "detection are off")
    flagged = inst.wait_status(r"WARNING: the hotfix shim is not loaded", "the shim warning")
    assert re.search(rf"^{inst.name} +healthy ", flagged.stdout, re.M), flagged.stdout
    assert message in flagged.stdout
    metrics = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    assert f'mlx_watchdog_shim_loaded{{instance="{inst.name}"}} 0.0' in metrics
    # Said once, loudly (ERROR), not every tick.
    time.sleep(3)  # a few more probe ticks (interval 1 s); no timing is asserted
    log = watchdog.log_path.read_text()
    assert log.count(message) == 1, log
    assert re.search(r"ERROR +\[" + re.escape(inst.name) + r"\] shim: " + re.escape(message), log)


def test_restart_name_finds_an_installed_instances_state_file(installs, tiny_llama, tmp_path):
    """`restart NAME` without --state-file looks where `status` looks: the
    installed instance's own NAME.state.json, whose daemon takes the request in
    `<state file>.control/` and runs the definition's restart (here launchd's
    `launchctl kickstart -k`, a stand-in on PATH that records its argv: there
    is no launchd here)."""
    inst = installs("launchd", tiny_llama)
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    calls = tmp_path / "launchctl.calls"
    launchctl = fake_bin / "launchctl"
    launchctl.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    launchctl.chmod(0o755)
    inst.start("server")
    inst.start("watchdog", PATH=f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    inst.wait_status(rf"^{inst.name} +healthy ", "healthy row")

    unknown = inst.cli("restart", "no-such-instance", "--no-wait")
    assert unknown.returncode == 1
    assert "no instance 'no-such-instance' in any state file" in unknown.stderr, unknown.stderr
    assert inst.name in unknown.stderr  # what there is instead

    done = inst.cli("restart", inst.name, "--no-wait", "--timeout", str(LOAD_S))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{inst.name}: restarted: ran launchctl kickstart -k" in done.stdout, done.stdout
    assert f"io.github.mlx-watchdog.{inst.name}.server" in calls.read_text()
