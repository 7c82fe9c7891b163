"""Groups across two hosts: rank 1 on a second host reached over a real ssh.

The second host is a private sshd on 127.0.0.2 (harness/remotehost.py), the
alias `mlxhost2`, in a real `mlx.launch --hostfile ... --backend ring` group
of the stock mlx_lm.server (tiny model). The remote rank runs the shim from
its own copy (`--remote-shim-path`), in the fresh environment sshd gives it;
the fault injector reaches it the same way (`--env`). Faults strike rank 1
only; the arm file names the fault, so one supervised group is struck by a
death, a hang, a partition and a lost session in turn (CI time).

After each: the client was answered, the group serves again, nothing of the
old group is left on the second host (its sessions, found by ancestry under
our sshd, and any process carrying the marker our sshd sets, which a rank
keeps when its session is gone), and exactly one rank runs there.
No timing assertions.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional

import psutil
import pytest
import requests

from harness import FAULTS_DIR
from harness.procs import chat_body
from harness.remotehost import SecondHost, alive
from harness.server import BackgroundRequest, base_env, free_port, python_for
from harness.procs import chat
from harness.watchdog_run import WatchdogProcess, wait_serving
from tests.test_group_real import FAST, LOAD_S

# One worker runs them all (scripts/test runs the suite in parallel): they share
# the second host, and its partition cuts 127.0.0.2 and 127.0.0.3 for everyone.
pytestmark = [pytest.mark.server, pytest.mark.xdist_group("second_host")]

DEATH = "raise:typeerror:decode"
HANG = "hang:decode"


def launch_command(version: str, model: Path, port: int, hostfile: Path, *,
                   host: str = "127.0.0.1", fault_env: Optional[dict] = None) -> List[str]:
    """mlx.launch over the hostfile; the fault injector reaches remote ranks by --env."""
    python = python_for(version)
    envs: List[str] = []
    for key, value in (fault_env or {}).items():
        envs += ["--env", f"{key}={value}"]
    return [str(python.parent / "mlx.launch"), "--hostfile", str(hostfile), "--backend", "ring",
            "--starting-port", str(free_port()), *envs, "--",
            str(python), "-m", "mlx_lm", "server", "--model", str(model),
            "--host", host, "--port", str(port)]


def remote_faults(arm: Path, spec: str = DEATH, **extra) -> dict:
    return {"PYTHONPATH": str(FAULTS_DIR), "MLX_TEST_FAULT": spec,
            "MLX_TEST_FAULT_ARM_FILE": str(arm), "MLX_TEST_FAULT_RANK": "1", **extra}


def arm_with(arm: Path, spec: str) -> None:
    """Arm the fault, naming it (atomically: the rank reads the file when it strikes)."""
    staged = arm.with_suffix(".tmp")
    staged.write_text(spec)
    os.replace(staged, arm)


class RemoteGroup:
    """A supervised two-host group and what the tests do to it."""

    def __init__(self, host: SecondHost, sup: WatchdogProcess, url: str, arm: Path):
        self.host, self.sup, self.url, self.arm = host, sup, url, arm

    def serving(self) -> None:
        wait_serving(self.url, LOAD_S, log=self.sup)
        self.sup.wait_for(lambda: len(self.host.ranks()) == 1, 60,
                          "exactly one rank on the second host")

    def remote_processes(self) -> List[psutil.Process]:
        return self.host.processes()

    def strikes(self) -> int:
        return self.sup.text().count("mlx-test-fault: ")

    def strike(self, spec: str) -> BackgroundRequest:
        before = self.strikes()
        arm_with(self.arm, spec)
        request = BackgroundRequest(
            lambda: chat(self.url, "tell me a story", max_tokens=20, timeout=120), name=spec)
        self.sup.wait_for(lambda: self.strikes() > before, 90, f"{spec} to strike rank 1")
        self.arm.unlink()
        return request

    def mark(self) -> int:
        """Where the supervisor's log is now: next_restart looks past it."""
        return len(self.sup.events())

    def next_restart(self, mark: int) -> dict:
        return self.sup.wait_event(lambda e: e["event"] == "restart", 180, "a restart",
                                   after=mark)

    def recovered(self, old: List[psutil.Process]) -> None:
        """Serving again; nothing of the old group on the second host; one rank there."""
        self.serving()
        self.sup.wait_for(lambda: not any(alive(p) for p in old), 60,
                          "every process of the old group on the second host to be gone")
        (rank,) = self.host.ranks()
        assert rank in self.host.sessions(), "the rank is not in a session of our sshd"
        assert rank.environ()["PYTHONPATH"].split(":")[0] == str(self.host.shim_dir)


def supervise_group(host: SecondHost, folder: Path, version: str, model: Path, *,
                    rank0_remote: bool = False, **faults) -> RemoteGroup:
    """`supervise` a two-host group (rank 1 on the second host, or rank 0 with
    rank0_remote); faults as remote_faults' extra variables."""
    port = free_port()
    arm = folder / "arm"
    hostfile = host.hostfile(folder / "hosts.json", rank0_remote=rank0_remote)
    # A remote rank 0 binds a wildcard: the probe finds it at its hostfile address.
    command = launch_command(version, model, port, hostfile,
                             host="0.0.0.0" if rank0_remote else "127.0.0.1",
                             fault_env=remote_faults(arm, **faults))
    env = host.env(base_env(shim=False, extra={"MLX_HOTFIX_REPORT_DIR": str(folder / "reports")}))
    sup = WatchdogProcess(folder, ["supervise", *FAST, "--remote-shim-path", str(host.shim_dir),
                                   "--", *command], env=env)
    address = host.address if rank0_remote else "127.0.0.1"
    return RemoteGroup(host, sup, f"http://{address}:{port}", arm)


class StreamingRequest:
    """A long streamed completion: tells when its first token came and how it ended."""

    def __init__(self, url: str):
        self.first = threading.Event()
        self.chunks: List[str] = []
        self.ended: Optional[str] = None
        self.status: Optional[int] = None
        self._thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self._thread.start()

    def _run(self, url: str) -> None:
        try:
            with requests.post(f"{url}/v1/chat/completions", stream=True, timeout=(5, 300),
                               json=chat_body("tell me a long story", max_tokens=100000,
                                              stream=True)) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line:
                        self.chunks.append(line.decode(errors="replace"))
                        self.first.set()
            self.ended = "closed"
        except requests.RequestException as exc:
            self.ended = type(exc).__name__
        finally:
            self.first.set()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()


def strike_and_recover(group: RemoteGroup, fault: str, cause: str) -> None:
    group.serving()
    old = group.remote_processes()
    assert any(p.pid == group.host.ranks()[0].pid for p in old)
    mark = group.mark()
    request = group.strike(fault)
    restart = group.next_restart(mark)
    assert restart["cause"] == cause, restart
    assert request.join(120), "the client was left waiting"
    if cause == "exited":
        assert request.status == 503, request
    group.recovered(old)


@pytest.fixture(scope="class")
def group(second_host, tiny_llama, tmp_path_factory):
    """One supervised 0.32.2 group for the class below, struck in turn (CI time:
    one start, then restarts); it ends with the class, not kept beside others."""
    group = supervise_group(second_host, tmp_path_factory.mktemp("remote-group"), "0.32.2",
                            tiny_llama)
    try:
        yield group
    finally:
        group.sup.cleanup()


class TestOneSupervisedGroupOverTwoHosts:

    @pytest.mark.parametrize("fault,cause", [(DEATH, "exited"), (HANG, "heartbeat-stale")],
                             ids=["death", "hang"])
    def test_a_remote_rank_death_or_hang_restarts_the_group(self, group, fault, cause):
        strike_and_recover(group, fault, cause)

    def test_a_partition_during_a_request_restarts_the_group_after_the_heal(self, group):
        group.serving()
        old = group.remote_processes()
        mark = group.mark()
        stream = StreamingRequest(group.url)
        assert stream.first.wait(120) and stream.chunks, "the stream never started"
        with group.host.partition():
            restart = group.next_restart(mark)
            assert restart["cause"] == "heartbeat-stale", restart
            # The client is answered while the second host is still cut off.
            assert stream.join(120), "the client was left waiting"
            assert stream.ended is not None and "[DONE]" not in stream.chunks[-1], \
                stream.chunks[-3:]
        group.recovered(old)

    def test_a_lost_session_restarts_the_group(self, group):
        group.serving()
        old = group.remote_processes()
        mark = group.mark()
        (rank,) = group.host.ranks()
        session = group.host.session_of(rank)  # the sshd child that carries rank 1
        assert session is not None and session.name() == "sshd", session
        session.send_signal(signal.SIGKILL)
        restart = group.next_restart(mark)
        assert restart["cause"] == "exited", restart
        group.recovered(old)


def test_a_remote_rank_death_restarts_the_group_on_0_31_3(second_host, tiny_llama, tmp_path):
    group = supervise_group(second_host, tmp_path, "0.31.3", tiny_llama)
    try:
        strike_and_recover(group, DEATH, "exited")
    finally:
        group.sup.cleanup()


def test_a_remote_rank_that_ignores_sigterm_ends_with_its_session(second_host, tiny_llama,
                                                                 tmp_path):
    """Upstream mlx #3910: a rank blocked in native code ignores SIGTERM. Our stop
    never relies on it: stopping the launcher's process group ends the ssh
    client, the session on the second host ends, and its hangup (SIGHUP) ends
    the rank. The rank notes every signal that reaches it: that one is SIGHUP."""
    trace = tmp_path / "signals"
    group = supervise_group(second_host, tmp_path, "0.32.2", tiny_llama,
                            MLX_TEST_IGNORE_SIGTERM=str(trace))
    try:
        group.serving()
        (rank,) = second_host.ranks()
        old = group.remote_processes()
        mark = group.mark()
        request = group.strike(HANG)
        assert group.next_restart(mark)["cause"] == "heartbeat-stale"
        assert request.join(120), "the client was left waiting"
        group.recovered(old)
        arrived = [line.split()[0] for line in trace.read_text().splitlines()
                   if f"pid={rank.pid} " in line]
        assert arrived == ["SIGHUP"], trace.read_text()
        assert group.sup.terminate() == 0
        group.sup.wait_for(lambda: second_host.ranks() == [], 60, "the last rank to end")
    finally:
        group.sup.cleanup()


def test_rank_0_on_the_second_host_is_probed_at_its_hostfile_address(second_host, tiny_llama,
                                                                     tmp_path):
    group = supervise_group(second_host, tmp_path, "0.32.2", tiny_llama, rank0_remote=True)
    try:
        group.serving()
        started = group.sup.wait_event(lambda e: e["event"] == "supervise", 10, "the start line")
        assert f"probing {group.url}" in started["message"], started
        assert group.url.startswith(f"http://{second_host.address}:")
        (rank,) = second_host.ranks()
        assert rank.environ()["MLX_RANK"] == "0"
        # Counted as the server's answers (the port is held on the other host,
        # not in the supervised tree: the listener check stands aside).
        group.sup.wait_for(lambda: group.sup.record().get("state") == "healthy", 60,
                           "a probe of rank 0 at its address to pass")
    finally:
        group.sup.cleanup()


# -- the definitions install writes --------------------------------------------------------


def test_the_installed_group_serves_over_two_hosts_and_exits_70_after_a_remote_death(
        second_host, tiny_llama, tmp_path):
    """`install systemd --hostfile --remote-shim-path`: its ExecStart, run as
    systemd would (the unit's environment, our ssh on PATH), brings up the
    two-host group, with the shim on the remote rank from the remote path;
    after a death there it ends 70, so Restart=on-failure starts it again."""
    from tests.test_install_e2e import _systemd_server

    port = free_port()
    hostfile = second_host.hostfile(tmp_path / "hosts.json")
    home = tmp_path / "home"
    home.mkdir()
    env = second_host.env({**os.environ, "HOME": str(home),
                           "XDG_CONFIG_HOME": str(home / ".config"),
                           "XDG_STATE_HOME": str(home / ".local" / "state")})
    out = tmp_path / "out"
    install = subprocess.run(
        [sys.executable, "-m", "mlx_watchdog", "install", "systemd", "--dry-run",
         "--output-dir", str(out), "--model", str(tiny_llama), "--python",
         str(python_for("0.32.2")), "--port", str(port), "--offline",
         "--hostfile", str(hostfile), "--backend", "ring",
         "--remote-shim-path", str(second_host.shim_dir)],
        env=env, capture_output=True, text=True, timeout=120)
    assert install.returncode == 0, install.stdout + install.stderr
    argv, definition_env = _systemd_server(out)
    launch = argv.index("exec") + 2  # mlx-watchdog exec -- <mlx.launch> ...
    assert argv[launch].endswith("mlx.launch") and argv[launch + 1] == "--hostfile", argv
    assert definition_env["MLX_WATCHDOG_REMOTE_SHIM"] == str(second_host.shim_dir)
    # The fault injector, for the remote rank only, as a user's own --env would be.
    arm = tmp_path / "arm"
    faults: List[str] = []
    for key, value in remote_faults(arm).items():
        faults += ["--env", f"{key}={value}"]
    argv[launch + 1:launch + 1] = faults
    run_env = {"PATH": env["PATH"], "HOME": str(home), **definition_env,
               "MLX_HOTFIX_REPORT_DIR": str(tmp_path / "reports")}
    url = f"http://127.0.0.1:{port}"
    proc = None
    try:
        # As systemd runs it (Restart=on-failure): a group that could not form
        # (the ring gives up waiting for a rank slow to start, on a loaded
        # machine) ends 70 and is started again.
        for attempt in range(3):
            log_path = tmp_path / f"server-{attempt}.log"
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(argv, env=run_env, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            if serves(url, proc, LOAD_S):
                break
            assert proc.returncode == 70, log_path.read_text()[-3000:]
        else:
            pytest.fail("the installed group never served:\n" + log_path.read_text()[-3000:])
        (rank,) = second_host.ranks()
        assert rank.environ()["MLX_RANK"] == "1"
        assert rank.environ()["PYTHONPATH"].split(":")[0] == str(second_host.shim_dir)
        text = log_path.read_text()
        assert "mlx-hotfix: [rank 1 on " in text and "exit applied" in text, text[-3000:]
        old = second_host.processes()
        arm_with(arm, DEATH)
        request = BackgroundRequest(lambda: chat(url, "hello", max_tokens=20, timeout=120))
        assert request.join(120) and request.status == 503, request
        # Upstream mlx.launch exits 0 here; the definition ends 70: restarted.
        assert proc.wait(120) == 70, log_path.read_text()[-3000:]
        assert "Node with rank" in log_path.read_text()  # the launcher saw a rank end
        deadline = time.monotonic() + 60
        while any(alive(p) for p in old) or second_host.ranks():
            assert time.monotonic() < deadline, "a process of the group is left on the host"
            time.sleep(0.2)
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def serves(url: str, proc: subprocess.Popen, timeout: float) -> bool:
    """True once url answers a 200 completion; False if proc ends first."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        assert time.monotonic() < deadline, f"{url} did not serve within {timeout:g}s"
        try:
            if chat(url, "are you there", max_tokens=1, timeout=(1, 30)).status_code == 200:
                return True
        except requests.RequestException:
            pass
        time.sleep(0.2)
    return False


# -- doctor --hostfile, and the fixture itself --------------------------------------------


def test_doctor_checks_every_host_of_the_hostfile_over_ssh(second_host, tmp_path, monkeypatch):
    from mlx_watchdog.doctor_hosts import FAIL, OK, check_hosts

    hostfile = second_host.hostfile(tmp_path / "hosts.json")
    python = str(python_for("0.32.2"))
    env = second_host.env(base_env(shim=False, extra={"XDG_STATE_HOME": str(tmp_path)}))
    run = subprocess.run([sys.executable, "-m", "mlx_watchdog", "doctor", "--json",
                          "--python", python, "--port", str(free_port()),
                          "--hostfile", str(hostfile),
                          "--remote-shim-path", str(second_host.shim_dir)],
                         env=env, capture_output=True, text=True, timeout=300)
    report = json.loads(run.stdout)
    hosts = {c["message"]: c["status"] for c in report["hosts"]}
    assert hosts[f"{second_host.alias}: reachable by ssh"] == OK, hosts
    assert hosts[f"{second_host.alias}: the hotfix shim is at {second_host.shim_dir}"] == OK
    assert any(m.startswith("every host runs mlx ") and s == OK for m, s in hosts.items())
    assert FAIL not in hosts.values(), hosts
    # The same checks, failing: the shim is not where the remote ranks would look,
    # then the host is cut off.
    monkeypatch.setenv("PATH", env["PATH"])
    checks = check_hosts(str(hostfile), python=python, shim_path=str(tmp_path / "no-shim"))
    assert (FAIL, f"{second_host.alias}: no hotfix shim at {tmp_path / 'no-shim'}") in \
        [c[:2] for c in checks]
    with second_host.partition():
        checks = check_hosts(str(hostfile), python=python, shim_path=str(second_host.shim_dir))
    failed = [message for status, message, _ in checks if status == FAIL]
    assert len(failed) == 1 and failed[0].startswith(
        f"{second_host.alias}: not reachable by `ssh -o BatchMode=yes {second_host.alias}`")


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def test_the_second_host_finds_a_rank_its_session_left_behind(second_host):
    """What the tests rely on: a rank that outlived its session (re-parented,
    no longer under our sshd) is still found on the second host."""
    # A group test before this one may still be ending its ranks: ours is the
    # one that sleeps this test's own number of seconds.
    seconds = str(300 + os.getpid() % 600)

    def ours():
        return [p for p in second_host.ranks() if seconds in _cmdline(p)]

    started = second_host.ssh("MLX_RANK=1 setsid bash -c 'exec -a \"python -m mlx_lm server\" "
                              f"sleep {seconds}' </dev/null >/dev/null 2>&1 &")
    assert started.returncode == 0, started.stderr
    deadline = time.monotonic() + 30
    while not ours():
        assert time.monotonic() < deadline, "the left-over rank is not found"
        time.sleep(0.1)
    (left,) = ours()
    try:
        assert left not in second_host.sessions()
        assert left in second_host.processes()
    finally:
        left.kill()
    left.wait(10)
    assert left not in second_host.ranks()
