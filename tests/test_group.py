"""Distributed groups (mlx_watchdog.group): our own logic, with fakes.

The real 2-rank groups are in test_group_real.py. Here: recognising an
mlx.launch command, rank 0's URL, the shim reaching remote ranks through
--env (proved with the real mlx.launch and a fake ssh that runs the "remote"
command locally in an empty environment), per-rank heartbeats, the hostfile
checks, and exec's exit mapping with a fake launcher.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from mlx_watchdog import group, group_heartbeats, group_install, group_ssh
from mlx_watchdog.group_heartbeats import GroupHeartbeat
from mlx_watchdog.group_hosts import GroupError
from mlx_watchdog.group_launch import parse_launch
from harness.fakes import Clock
from harness.server import python_for

SERVER = ["python", "-m", "mlx_lm", "server", "--model", "m", "--port", "9000"]


def hostfile(tmp_path: Path, *hosts, name="hosts.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps([{"ssh": h, "ips": [ip]} for h, ip in hosts]))
    return str(path)


# -- recognising the command -----------------------------------------------------------


@pytest.mark.parametrize("launcher", [
    ["mlx.launch"], ["/opt/venv/bin/mlx.launch"], ["python", "-m", "mlx.launch"],
    ["/usr/bin/python3.11", "-m", "mlx._distributed_utils.launch"], ["python3", "-mmlx.launch"],
])
def test_every_form_of_mlx_launch_is_recognised(launcher):
    command = parse_launch([*launcher, "-n", "2", "--backend", "ring", *SERVER])
    assert command is not None
    assert command.launcher == launcher and command.server == SERVER
    assert [h.ssh for h in command.hosts] == ["127.0.0.1", "127.0.0.1"]
    assert command.backend == "ring" and command.local_ranks == [0, 1]
    assert command.argv == [*launcher, "-n", "2", "--backend", "ring", "--", *SERVER]


@pytest.mark.parametrize("argv", [SERVER, ["mlx_lm.server", "--port", "1"],
                                  ["python", "-m", "mlx_lm", "server"], ["launch"]])
def test_other_commands_are_not_groups(argv):
    assert parse_launch(argv) is None


def test_launcher_options_with_equals_and_double_dash():
    command = parse_launch(["mlx.launch", "--hosts=10.0.0.1,10.0.0.2", "--env", "A=1", "--",
                            *SERVER])
    assert [h.ssh for h in command.hosts] == ["10.0.0.1", "10.0.0.2"]
    assert command.remote_hosts == ["10.0.0.1", "10.0.0.2"]
    assert command.server == SERVER


def test_a_launch_without_a_command_is_a_clear_error():
    with pytest.raises(GroupError, match="no command"):
        parse_launch(["mlx.launch", "-n", "2"])
    with pytest.raises(GroupError, match="needs a value"):
        parse_launch(["mlx.launch", "--hostfile"])


def test_bad_hostfiles_are_named(tmp_path):
    with pytest.raises(GroupError, match="does not exist"):
        parse_launch(["mlx.launch", "--hostfile", str(tmp_path / "nope.json"), *SERVER])
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(GroupError, match="not readable JSON"):
        parse_launch(["mlx.launch", "--hostfile", str(tmp_path / "bad.json"), *SERVER])
    (tmp_path / "nossh.json").write_text('[{"ips": ["1.2.3.4"]}]')
    with pytest.raises(GroupError, match='host 0 has no "ssh"'):
        parse_launch(["mlx.launch", "--hostfile", str(tmp_path / "nossh.json"), *SERVER])


# -- rank 0's address ------------------------------------------------------------------


def test_the_probe_targets_rank_0(tmp_path):
    local = parse_launch(["mlx.launch", "-n", "2", *SERVER])
    assert local.probe_url() == "http://127.0.0.1:9000"
    remote = parse_launch(["mlx.launch", "--hostfile",
                           hostfile(tmp_path, ("studio-1", "10.0.0.5"), ("studio-2", "10.0.0.6")),
                           *SERVER[:-2], "--host", "0.0.0.0", "--port", "9000"])
    assert remote.probe_url() == "http://10.0.0.5:9000"
    named = parse_launch(["mlx.launch", "--hostfile",
                          hostfile(tmp_path, ("studio-1", "10.0.0.5"), ("studio-2", "10.0.0.6")),
                          *SERVER, "--host", "studio-1.lan"])
    assert named.probe_url() == "http://studio-1.lan:9000"


# -- the shim on every rank ------------------------------------------------------------


def test_remote_ranks_get_the_shim_and_its_settings_through_env(tmp_path):
    path = hostfile(tmp_path, ("127.0.0.1", "127.0.0.1"), ("studio-2", "10.0.0.6"))
    env = {"PYTHONPATH": "/here/shim", "MLX_HOTFIX_DISABLE": "advance",
           "MLX_HOTFIX_HEARTBEAT_FILE": "/private/hb", "HF_HUB_OFFLINE": "1", "OTHER": "x",
           # install sets it; a remote rank writes into its own host's default folder
           "MLX_HOTFIX_REPORT_DIR": "/var/lib/mlx-watchdog/reports"}
    command = group.prepare(["mlx.launch", "--hostfile", path, *SERVER], env,
                            private_dir=tmp_path, remote_shim_path="/there/shim")
    options = command.options
    assert options[:2] == ["--hostfile", path]
    pairs = [options[i + 1] for i, a in enumerate(options) if a == "--env"]
    # mlx.launch exports --env on local ranks too: they keep this machine's shim.
    assert pairs == ["PYTHONPATH=/there/shim:/here/shim", "MLX_HOTFIX_DISABLE=advance",
                     "HF_HUB_OFFLINE=1"]
    # Discovered: the same path as this installation's shim.
    command = group.prepare(["mlx.launch", "--hostfile", path, *SERVER], {},
                            private_dir=tmp_path)
    from mlx_watchdog.shim import shim_dir

    assert f"PYTHONPATH={shim_dir()}" in command.options
    # A local-only group needs nothing: the ranks inherit the environment.
    local = group.prepare(["mlx.launch", "-n", "2", *SERVER], env, private_dir=tmp_path)
    assert "--env" not in local.options


def test_the_commands_own_env_for_remote_ranks_stands_with_the_shim_in_front(tmp_path):
    path = hostfile(tmp_path, ("127.0.0.1", "127.0.0.1"), ("studio-2", "10.0.0.6"))
    env = {"MLX_HOTFIX_DISABLE": "advance", "HF_HUB_OFFLINE": "1"}
    command = group.prepare(["mlx.launch", "--hostfile", path, "--env", "PYTHONPATH=/my/libs",
                             "--env=MLX_HOTFIX_DISABLE=extend", *SERVER],
                            {**env, "PYTHONPATH": "/here/shim:/my/libs"},
                            private_dir=tmp_path, remote_shim_path="/there/shim")
    # mlx.launch exports in order: the last assignment of a name wins.
    assert command.launch_env() == {"PYTHONPATH": "/there/shim:/my/libs:/here/shim",
                                    "MLX_HOTFIX_DISABLE": "extend", "HF_HUB_OFFLINE": "1"}


def test_this_machines_names_in_a_hostfile_run_locally(tmp_path):
    path = hostfile(tmp_path, ("localhost", "127.0.0.1"), ("127.0.0.1", "127.0.0.1"))
    command = group.prepare(["mlx.launch", "--hostfile", path, *SERVER], {},
                            private_dir=tmp_path)
    assert command.hostfile != path and command.remote_hosts == []
    assert [h.ssh for h in command.hosts] == ["127.0.0.1", "127.0.0.1"]
    assert command.options[command.options.index("--hostfile") + 1] == command.hostfile


FAKE_SSH = """#!/bin/bash
# A fake ssh: logs the host, then runs the command here in an EMPTY
# environment, as a fresh login on another machine would.
while [[ "$1" == -* ]]; do
  if [[ "$1" == "-o" ]]; then shift; fi
  shift
done
host="$1"; shift
echo "$host" >> "$FAKE_SSH_LOG"
exec env -i PATH=/usr/bin:/bin HOME="$HOME" /bin/bash -c "$*"
"""


def test_the_shim_reaches_a_remote_rank_through_the_real_launcher(tmp_path):
    """Real mlx.launch, fake ssh: the 'remote' rank sees only what --env passed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    python = str(python_for("0.32.2"))
    launcher = str(Path(python).parent / "mlx.launch")
    path = hostfile(tmp_path, ("127.0.0.1", "127.0.0.1"), ("studio-2", "127.0.0.1"))
    report = ("import os, sys; sys.path.insert(0, os.environ.get('PYTHONPATH', '')); "
              "from mlx_hotfix.group import describe; "
              "print('RANK', describe(), os.environ.get('PYTHONPATH'))")
    here = tmp_path / "local-libs"  # what the local rank inherits on PYTHONPATH
    here.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "FAKE_SSH_LOG": str(tmp_path / "ssh.log"), "PYTHONPATH": str(here)}
    command = group.prepare([launcher, "--hostfile", path, "--backend", "ring", "--",
                             python, "-c", report], env, private_dir=tmp_path,
                            remote_shim_path=str(Path(__file__).parents[1] / "sitecustomize"))
    result = subprocess.run(command.argv, env=env, capture_output=True, text=True, timeout=120)
    assert (tmp_path / "ssh.log").read_text().split() == ["studio-2"]
    lines = sorted(l for l in result.stdout.splitlines() if l.startswith("RANK"))
    shim = str(Path(__file__).parents[1] / "sitecustomize")
    assert len(lines) == 2, result.stdout + result.stderr
    assert lines[0].startswith("RANK rank 0 on ") and lines[1].startswith("RANK rank 1 on ")
    # The remote rank got the shim via --env; mlx.launch exports it on the
    # local rank too, which keeps what it inherited after it.
    assert lines[1].endswith(f"{shim}:{here}"), lines
    assert lines[0].endswith(f"{shim}:{here}"), lines


# -- per-rank heartbeats ---------------------------------------------------------------


def beat(path: Path, *, age: float, rank: int, phase="serving", beats=1, now=None):
    now = time.time() if now is None else now
    path.write_text(json.dumps({"pid": 100 + rank, "beats": beats, "time": now - age,
                                "phase": phase, "rank": rank, "host": "h"}))


def test_a_stale_rank_makes_the_group_heartbeat_stale(tmp_path):
    # One clock for the files' timestamps and the tracker, moved by hand: a
    # beat's age is bounded by what the tracker saw itself between reads, so
    # the test must move time as a real hang would.
    clock = Clock(1_000_000.0)
    base = tmp_path / "hb.json"
    tracker = GroupHeartbeat(base, clock=clock, monotonic=clock)
    assert tracker.sample() is None
    beat(base, age=0.1, rank=0, now=clock.now)
    assert tracker.sample().pid == 100
    beat(Path(f"{base}.rank1"), age=0.0, rank=1, now=clock.now)
    assert tracker.sample() is not None
    clock.now += 30  # rank 1 stops beating; rank 0 goes on
    beat(base, age=0.0, rank=0, beats=2, now=clock.now)
    reading = tracker.sample()
    assert reading.pid == 101 and reading.age_s >= 29
    clock.now += 40  # now rank 0 stops (waiting in a collective); rank 1 beats again
    beat(Path(f"{base}.rank1"), age=0.0, rank=1, beats=2, now=clock.now)
    reading = tracker.sample()
    assert reading.pid == 100 and reading.age_s >= 39  # the group hangs
    group_heartbeats.clear_heartbeats(base)
    assert not base.exists() and group_heartbeats.rank_heartbeat_files(base) == []


def test_the_shim_writes_each_ranks_heartbeat_with_rank_and_host(tmp_path):
    shim = Path(__file__).parents[1] / "sitecustomize"
    code = textwrap.dedent("""
        import json, os, sys
        from mlx_hotfix import config, heartbeat
        heartbeat.loop_iteration()
        print(config.current().heartbeat_file)
    """)
    base = tmp_path / "hb.json"
    for rank in ("0", "1"):
        env = {**os.environ, "PYTHONPATH": str(shim), "MLX_RANK": rank,
               "MLX_HOTFIX_HEARTBEAT_FILE": str(base)}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
    record0 = json.loads(base.read_text())
    record1 = json.loads(Path(f"{base}.rank1").read_text())
    assert (record0["rank"], record1["rank"]) == (0, 1)
    assert record0["host"] == record1["host"] == os.uname().nodename


# -- hostfile checks (install, doctor) --------------------------------------------------


class FakeRun:
    """subprocess.run for ssh/bash: answers per host."""

    def __init__(self, reachable=(), versions=None):
        self.reachable = set(reachable)
        self.versions = versions or {}
        self.calls = []

    def __call__(self, argv, **kwargs):
        self.calls.append(argv)
        host = argv[-2] if argv[0] == "ssh" else "127.0.0.1"
        if argv[0] == "ssh" and host not in self.reachable:
            return subprocess.CompletedProcess(argv, 255, "", "Permission denied (publickey).")
        if argv[-1] == "true":
            return subprocess.CompletedProcess(argv, 0, "", "")
        mlx, lm, shim = self.versions.get(host, ("0.32.4", "0.32.2", True))
        out = json.dumps({"mlx": mlx, "mlx-lm": lm, "shim": shim})
        return subprocess.CompletedProcess(argv, 0, out + "\n", "")


def test_install_refuses_unreachable_hosts_and_accepts_local_ones(tmp_path):
    python = str(python_for("0.32.2"))
    local = hostfile(tmp_path, ("localhost", "127.0.0.1"), ("127.0.0.1", "127.0.0.1"))
    options = group_install.install_options(python=python, hostfile=local, hosts=None, backend="ring",
                                    run=FakeRun())
    assert options[0].endswith("/mlx.launch") and options[1:] == ("--hostfile", local,
                                                                    "--backend", "ring")
    remote = hostfile(tmp_path, ("127.0.0.1", "127.0.0.1"), ("studio-2", "10.0.0.6"),
                      name="remote.json")
    with pytest.raises(GroupError, match="(?s)cannot reach every host.*studio-2.*BatchMode"):
        group_install.install_options(python=python, hostfile=remote, hosts=None, backend=None,
                              run=FakeRun())
    assert group_install.install_options(python=python, hostfile=remote, hosts=None, backend=None,
                                 run=FakeRun(reachable={"studio-2"}))
    with pytest.raises(GroupError, match="not both"):
        group_install.install_options(python=python, hostfile=local, hosts="a,b", backend=None)
    with pytest.raises(GroupError, match="at least two"):
        group_install.install_options(python=python, hostfile=None, hosts="127.0.0.1", backend=None)
    assert group_install.install_options(python=python, hostfile=None, hosts=None, backend=None) is None


# -- a host name ssh would read as an option (issue 18) ----------------------------------


def test_a_host_named_like_an_ssh_option_is_refused_before_ssh_runs(tmp_path):
    # With the real ssh: "-oProxyCommand=touch FILE" as a host ran the command
    # here, during `install --dry-run`, with --hosts, and in `doctor --hostfile`.
    marker = tmp_path / "ran"
    evil = f"-oProxyCommand=touch {marker}"
    path = hostfile(tmp_path, ("127.0.0.1", "127.0.0.1"), (evil, "10.0.0.6"))
    python = str(python_for("0.32.2"))
    from mlx_watchdog.doctor_hosts import FAIL, check_hosts

    problems = [message for status, message, _ in check_hosts(path, python=python, shim_path="/s")
                if status == FAIL]
    assert len(problems) == 1 and "host 1: host name '-oProxyCommand=touch" in problems[0]
    assert "starts with '-', which ssh reads as an option" in problems[0]
    with pytest.raises(GroupError, match="starts with '-'"):
        group_install.install_options(python=python, hostfile=path, hosts=None, backend=None)
    with pytest.raises(GroupError, match="--hosts: host name '-oProxyCommand"):
        group_install.install_options(python=python, hostfile=None, hosts=f"127.0.0.1,{evil}",
                              backend=None)
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "model").mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "mlx_watchdog", "install", "systemd", "--dry-run",
         "--output-dir", str(tmp_path / "out"), "--model", str(tmp_path / "model"),
         "--python", python, "--port", "8080", "--offline", "--hostfile", path],
        env={**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config")},
        capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "starts with '-'" in done.stdout + done.stderr
    assert not marker.exists()


def test_every_ssh_we_run_ends_its_options_before_the_host():
    argv = group_ssh.ssh_check_argv("studio-2", "true")
    assert argv[-3:] == ["--", "studio-2", "true"]
    with pytest.raises(GroupError):
        group_ssh.ssh_check_argv("-oProxyCommand=x")


# -- exec: the launcher's exit 0 after a rank death ---------------------------------------

FAKE_LAUNCHER = """
import os, subprocess, sys, time
# Like mlx.launch: two 'ranks' in our process group; when one fails, stop
# the other, say so, and exit 0.
mode, pid_file = sys.argv[-2:]
ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
         for _ in range(2)]
open(pid_file, "w").write(" ".join(str(r.pid) for r in ranks))
if mode == "rank-dies":
    time.sleep(0.5)
    ranks[1].kill(); ranks[0].terminate()
    print("Node with rank 1 exited with code 70", file=sys.stderr)
    sys.exit(0)
if mode == "fails":
    sys.exit(3)
time.sleep(600)
"""


def run_exec(tmp_path, mode):
    script = tmp_path / "mlx.launch"
    script.write_text(f"#!{sys.executable}\n{FAKE_LAUNCHER}")
    script.chmod(0o755)
    pids = tmp_path / "pids"
    proc = subprocess.Popen([sys.executable, "-m", "mlx_watchdog", "exec", "--", str(script),
                             "-n", "2", "--", mode, str(pids)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, pids


@pytest.fixture
def reaper():
    """Kill what a failed exec test leaves: exec, and the fake launcher's group."""
    procs = []
    yield procs.append
    for proc in procs:
        for child in psutil.Process(proc.pid).children(recursive=True) \
                if psutil.pid_exists(proc.pid) else []:
            child.kill()
        proc.kill()
        proc.wait(10)


@pytest.mark.parametrize("mode,expected", [("rank-dies", 70), ("fails", 3)])
def test_exec_turns_a_groups_end_into_a_failure(tmp_path, mode, expected, reaper):
    proc, _ = run_exec(tmp_path, mode)
    reaper(proc)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == expected, err
    if mode == "rank-dies":
        assert "mlx.launch exited 0" in err and "exiting 70" in err


def test_exec_stops_the_whole_group_on_sigterm(tmp_path, reaper):
    proc, pids = run_exec(tmp_path, "serve")
    reaper(proc)
    deadline = time.monotonic() + 60
    while not (pids.exists() and pids.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    ranks = [int(p) for p in pids.read_text().split()]
    proc.terminate()
    assert proc.wait(60) == 0
    for pid in ranks:  # no rank left behind
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
