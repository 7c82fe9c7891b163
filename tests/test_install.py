"""`mlx-watchdog install` / `uninstall` for launchd and systemd.

Nothing here touches the real system: HOME and the XDG folders point into
tmp_path, and fake `launchctl` / `systemctl` executables first on PATH append
their argv as JSON lines to a log (exit status controllable by env).
"""

from __future__ import annotations

import json
import os
import plistlib
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
from click.testing import CliRunner

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from mlx_watchdog import shim
from mlx_watchdog.install import instance, launchd, reference, systemd
from mlx_watchdog.cli import main

REPO = Path(__file__).resolve().parents[1]
REAL_SHIM_DIR = shim.shim_dir  # the env fixture swaps in a stand-in
PYTHON = sys.executable  # a real python with mlx_lm: ExecStart must exist for verify
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_verify = pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed")

FAKE_LAUNCHCTL = r'''
import json, os, plistlib, sys
args = sys.argv[1:]
with open(os.environ["FAKE_CMD_LOG"], "a") as fh:
    fh.write(json.dumps(["launchctl"] + args) + "\n")
state = os.environ["FAKE_LAUNCHCTL_STATE"]
loaded = set(json.load(open(state))) if os.path.exists(state) else set()
def save():
    with open(state, "w") as fh:
        json.dump(sorted(loaded), fh)
cmd = args[0] if args else ""
if cmd in os.environ.get("FAKE_LAUNCHCTL_FAIL", "").split(","):
    sys.stderr.write(f"{cmd} failed: 5: Input/output error\n")
    sys.exit(5)
if cmd == "print":
    label = args[1].split("/", 2)[2]
    if label in loaded:
        print(args[1] + " = { state = running }")
        sys.exit(0)
    sys.stderr.write(f'Could not find service "{label}" in domain for port\n')
    sys.exit(113)
if cmd == "bootstrap":
    with open(args[2], "rb") as fh:
        label = plistlib.load(fh)["Label"]
    if label in loaded:
        sys.stderr.write("Bootstrap failed: 5: Input/output error\n")
        sys.exit(5)
    loaded.add(label)
    save()
    sys.exit(0)
if cmd == "bootout":
    label = args[1].split("/", 2)[2]
    if label not in loaded:
        sys.stderr.write("Boot-out failed: 3: No such process\n")
        sys.exit(3)
    loaded.discard(label)
    save()
    sys.exit(0)
sys.exit(64)
'''

FAKE_SYSTEMCTL = r'''
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_CMD_LOG"], "a") as fh:
    fh.write(json.dumps(["systemctl"] + args) + "\n")
words = [a for a in args if not a.startswith("--")]
cmd = words[0] if words else ""
if cmd in os.environ.get("FAKE_SYSTEMCTL_FAIL", "").split(","):
    sys.stderr.write(f"Failed to {cmd} unit: Access denied\n")
    sys.exit(1)
if cmd in ("enable", "disable", "restart", "cat"):
    unit_dir = os.environ["FAKE_SYSTEMD_UNIT_DIR"]
    for unit in words[1:]:
        path = unit if unit.startswith("/") else os.path.join(unit_dir, unit)
        if not os.path.exists(path):
            sys.stderr.write(f"Failed to {cmd} unit: Unit file {unit} does not exist.\n")
            sys.exit(1)
sys.exit(0)
'''


# --------------------------------------------------------------------------
# fixtures and helpers
# --------------------------------------------------------------------------


class Env:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.home = tmp_path / "home"
        self.bin = tmp_path / "fakebin"
        self.log = tmp_path / "commands.jsonl"
        self.shim = tmp_path / "shim"
        self.model = tmp_path / "models" / "demo"
        self.uid = os.getuid()

    @property
    def launch_agents(self) -> Path:
        return self.home / "Library" / "LaunchAgents"

    @property
    def support(self) -> Path:
        return self.home / "Library" / "Application Support" / "mlx-watchdog"

    @property
    def user_units(self) -> Path:
        return self.home / ".config" / "systemd" / "user"

    @property
    def user_config(self) -> Path:
        return self.home / ".config" / "mlx-watchdog"

    def launchd_targets(self, name: str) -> List[str]:
        """launchctl's gui/UID/LABEL of the watchdog and the server."""
        return [f"gui/{self.uid}/io.github.mlx-watchdog.{name}.{role}"
                for role in ("watchdog", "server")]

    def calls(self) -> List[List[str]]:
        if not self.log.exists():
            return []
        calls = [json.loads(line) for line in self.log.read_text().splitlines()]
        self.log.unlink()
        return calls

    def install_argv(self, manager: str, *args: str, port: int, model: str = None) -> List[str]:
        return ["install", manager, "--model", model or str(self.model), "--port", str(port),
                "--python", PYTHON, *args]

    def install(self, manager: str, *args: str, port: int, model: str = None):
        return invoke(self.install_argv(manager, *args, port=port, model=model))

    def installed(self, manager: str, *args: str, port: int = None, model: str = None):
        """install, which must succeed; (port, default instance name)."""
        port = free_port() if port is None else port
        result = self.install(manager, *args, port=port, model=model)
        assert result.exit_code == 0, result.output
        return port, f"mlx-{port}"

    def fails_at(self, monkeypatch, command: str, argv: List[str]):
        """argv (install or uninstall) with the fake manager's `command`
        failing: exit status 1, naming the command. Returns the result."""
        tool = "launchctl" if argv[1] == "launchd" else "systemctl"
        monkeypatch.setenv(f"FAKE_{tool.upper()}_FAIL", command)
        result = invoke(argv)
        monkeypatch.delenv(f"FAKE_{tool.upper()}_FAIL")
        assert result.exit_code == 1, result.output
        assert f"{tool} " in result.output and f" {command}" in result.output, result.output
        return result


def invoke(argv):
    result = CliRunner().invoke(main, argv, catch_exceptions=False)
    return result


def _write_exe(path: Path, body: str, python: str = PYTHON) -> None:
    path.write_text(f"#!{python} -S\n{body}")
    path.chmod(0o755)


@pytest.fixture
def env(tmp_path, monkeypatch) -> Env:
    e = Env(tmp_path)
    e.home.mkdir()
    e.bin.mkdir()
    e.shim.mkdir()
    (e.shim / "sitecustomize.py").write_text("# test shim\n")
    e.model.mkdir(parents=True)
    _write_exe(e.bin / "launchctl", FAKE_LAUNCHCTL)
    _write_exe(e.bin / "systemctl", FAKE_SYSTEMCTL)
    monkeypatch.setenv("HOME", str(e.home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.setenv("PATH", f"{e.bin}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("FAKE_CMD_LOG", str(e.log))
    monkeypatch.setenv("FAKE_LAUNCHCTL_STATE", str(tmp_path / "launchctl-state.json"))
    monkeypatch.setenv("FAKE_SYSTEMD_UNIT_DIR", str(e.user_units))
    monkeypatch.delenv("FAKE_LAUNCHCTL_FAIL", raising=False)
    monkeypatch.delenv("FAKE_SYSTEMCTL_FAIL", raising=False)
    # The drop-in folder is being written by a colleague; use a stand-in.
    monkeypatch.setattr(shim, "shim_dir", lambda: e.shim)
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_plist(path: Path) -> dict:
    with open(path, "rb") as fh:
        return plistlib.load(fh)


def tree(root: Path) -> List[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def systemd_verify(tmp_path: Path, paths, *, user: bool = False) -> None:
    """systemd-analyze verify: exit 0 and no complaint about our units.

    As root without a user manager, `--user verify` needs an XDG_RUNTIME_DIR;
    any private folder will do.
    """
    cmd = [SYSTEMD_ANALYZE] + (["--user"] if user else []) + ["verify"] + [str(p) for p in paths]
    env = dict(os.environ)
    if user:
        run_dir = tmp_path / "xdg-runtime"
        run_dir.mkdir(mode=0o700, exist_ok=True)
        env["XDG_RUNTIME_DIR"] = str(run_dir)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    names = [Path(p).name for p in paths]
    complaints = [line for line in proc.stderr.splitlines() if any(n in line for n in names)]
    assert complaints == [], proc.stderr


# --------------------------------------------------------------------------
# launchd
# --------------------------------------------------------------------------


def test_launchd_install_writes_plists_and_bootstraps(env):
    port, name = env.installed("launchd")

    server = env.launch_agents / f"io.github.mlx-watchdog.{name}.server.plist"
    watchdog = env.launch_agents / f"io.github.mlx-watchdog.{name}.watchdog.plist"
    uid = env.uid
    assert env.calls() == [
        ["launchctl", "print", f"gui/{uid}/io.github.mlx-watchdog.{name}.watchdog"],
        ["launchctl", "print", f"gui/{uid}/io.github.mlx-watchdog.{name}.server"],
        ["launchctl", "bootstrap", f"gui/{uid}", str(server)],
        ["launchctl", "bootstrap", f"gui/{uid}", str(watchdog)],
    ]

    s = load_plist(server)
    assert s["Label"] == f"io.github.mlx-watchdog.{name}.server"
    assert s["ProgramArguments"] == [
        PYTHON, "-m", "mlx_lm", "server", "--model", str(env.model),
        "--host", "127.0.0.1", "--port", str(port),
    ]
    heartbeat = env.support / f"{name}.heartbeat"
    assert s["EnvironmentVariables"] == {
        "PYTHONPATH": str(env.shim),
        "MLX_HOTFIX_HEARTBEAT_FILE": str(heartbeat),
        "PYTHONUNBUFFERED": "1",
        "MLX_HOTFIX_INSTANCE": name,
        "MLX_HOTFIX_LAUNCHD_SOCKET": "Listeners",  # the shim asks launchd for it
        # Given to both jobs: server and watchdog agree on it whatever users they run as.
        "MLX_HOTFIX_REPORT_DIR": str(env.home / "Library" / "Logs" / "mlx-watchdog" / "reports"),
    }
    # launchd holds the listening socket (launchd.plist(5) Sockets keys).
    assert s["Sockets"] == {"Listeners": {"SockNodeName": "127.0.0.1",
                                          "SockServiceName": str(port),
                                          "SockType": "stream", "SockFamily": "IPv4"}}
    assert "NOTIFY_SOCKET" not in s["EnvironmentVariables"]
    assert "HF_HUB_OFFLINE" not in s["EnvironmentVariables"]
    assert s["KeepAlive"] == {"SuccessfulExit": False, "Crashed": True}
    assert s["ThrottleInterval"] == launchd.SERVER_THROTTLE_INTERVAL == 30
    assert s["RunAtLoad"] is True
    assert s["ProcessType"] == "Interactive"
    logs = env.home / "Library" / "Logs" / "mlx-watchdog"
    assert s["StandardOutPath"] == str(logs / f"{name}.out.log")
    assert s["StandardErrorPath"] == str(logs / f"{name}.err.log")
    assert logs.is_dir()  # launchd does not create it

    w = load_plist(watchdog)
    config = env.support / f"{name}.toml"
    assert w["Label"] == f"io.github.mlx-watchdog.{name}.watchdog"
    assert w["ProgramArguments"] == [
        str(Path(PYTHON).parent / "mlx-watchdog"), "watch", "--config", str(config)]
    assert w["KeepAlive"] is True
    assert w["RunAtLoad"] is True
    assert w["ThrottleInterval"] == 10
    assert "PYTHONPATH" not in w["EnvironmentVariables"]
    assert "NOTIFY_SOCKET" not in w["EnvironmentVariables"]
    assert w["EnvironmentVariables"]["MLX_HOTFIX_REPORT_DIR"] == \
        s["EnvironmentVariables"]["MLX_HOTFIX_REPORT_DIR"]

    cfg = tomllib.loads(config.read_text())
    assert cfg == {
        "state_file": str(env.support / f"{name}.state.json"),
        "instances": {name: {
            "url": f"http://127.0.0.1:{port}",
            "model": "default_model",
            "heartbeat_file": str(heartbeat),
            "caffeinate": True,  # the watchdog keeps the Mac awake (unless --allow-sleep)
            "restart": {"type": "launchd", "label": f"io.github.mlx-watchdog.{name}.server"},
        }},
    }
    manifest = json.loads((env.support / f"{name}.install.json").read_text())
    assert sorted(manifest["files"]) == sorted(
        [str(server), str(watchdog), str(config), str(env.support / f"{name}.install.json")])


def test_launchd_reinstall_boots_out_then_bootstraps_and_updates(env):
    port, name = env.installed("launchd")
    env.calls()
    result = env.install("launchd", "--offline", port=port)
    assert result.exit_code == 0, result.output
    uid = env.uid
    w, s = env.launchd_targets(name)
    assert env.calls() == [
        ["launchctl", "print", w],
        ["launchctl", "bootout", w],
        ["launchctl", "print", w],  # gone: ready to bootstrap again
        ["launchctl", "print", s],
        ["launchctl", "bootout", s],
        ["launchctl", "print", s],
        ["launchctl", "bootstrap", f"gui/{uid}",
         str(env.launch_agents / f"io.github.mlx-watchdog.{name}.server.plist")],
        ["launchctl", "bootstrap", f"gui/{uid}",
         str(env.launch_agents / f"io.github.mlx-watchdog.{name}.watchdog.plist")],
    ]
    plist = load_plist(env.launch_agents / f"io.github.mlx-watchdog.{name}.server.plist")
    assert plist["EnvironmentVariables"]["HF_HUB_OFFLINE"] == "1"


def test_launchd_uninstall_boots_out_and_removes_only_its_files(env):
    port, name = env.installed("launchd")
    env.calls()
    # Unrelated files next to ours must survive.
    env.launch_agents.joinpath("com.example.other.plist").write_bytes(
        plistlib.dumps({"Label": "com.example.other"}))
    env.support.joinpath("notes.txt").write_text("mine")
    env.support.joinpath(f"{name}.state.json").write_text("{}")  # written by the watchdog

    result = invoke(["uninstall", "launchd", "--name", name])
    assert result.exit_code == 0, result.output
    w, s = env.launchd_targets(name)
    assert env.calls() == [
        ["launchctl", "print", w],
        ["launchctl", "bootout", w],
        ["launchctl", "print", s],
        ["launchctl", "bootout", s],
    ]
    assert tree(env.launch_agents) == ["com.example.other.plist"]
    assert tree(env.support) == [f"{name}.state.json", "notes.txt"]


def test_launchd_bootstrap_failure_is_reported_and_files_stay(env, monkeypatch):
    port = free_port()
    name = f"mlx-{port}"
    result = env.fails_at(monkeypatch, "bootstrap", env.install_argv("launchd", port=port))
    assert "exit status 5" in result.output
    assert "Input/output error" in result.output
    assert f"mlx-watchdog uninstall launchd --name {name}" in result.output
    calls = env.calls()
    assert calls[-1][:2] == ["launchctl", "bootstrap"]  # stopped at the first failure
    assert len([c for c in calls if c[1] == "bootstrap"]) == 1
    # The files are in place (and recorded), so uninstall can clean up.
    assert len(tree(env.launch_agents)) == 2
    assert (env.support / f"{name}.install.json").exists()

    result = invoke(["uninstall", "launchd", "--port", str(port)])
    assert result.exit_code == 0, result.output
    assert [c[1] for c in env.calls()] == ["print", "print"]  # nothing loaded: no bootout
    assert tree(env.launch_agents) == []
    assert tree(env.support) == []


def test_launchd_bootout_failure_keeps_files(env, monkeypatch):
    port, _ = env.installed("launchd")
    env.fails_at(monkeypatch, "bootout", ["uninstall", "launchd", "--port", str(port)])
    assert len(tree(env.launch_agents)) == 2


def test_launchd_two_instances_get_their_own_labels(env):
    p1, p2 = free_port(), free_port()
    while p2 == p1:
        p2 = free_port()
    env.installed("launchd", port=p1)
    env.installed("launchd", "--name", "second", port=p2)
    plists = sorted(env.launch_agents.glob("*.plist"))
    labels = [load_plist(p)["Label"] for p in plists]
    assert len(labels) == 4 and len(set(labels)) == 4
    assert set(labels) == {
        f"io.github.mlx-watchdog.mlx-{p1}.server", f"io.github.mlx-watchdog.mlx-{p1}.watchdog",
        "io.github.mlx-watchdog.second.server", "io.github.mlx-watchdog.second.watchdog",
    }
    for plist in plists:
        assert plist.name == load_plist(plist)["Label"] + ".plist"
    cfg = tomllib.loads((env.support / "second.toml").read_text())
    assert cfg["instances"]["second"]["url"] == f"http://127.0.0.1:{p2}"
    assert cfg["state_file"] != tomllib.loads(
        (env.support / f"mlx-{p1}.toml").read_text())["state_file"]

    # A third instance may not reuse an installed instance's port.
    result = env.install("launchd", "--name", "third", port=p2)
    assert result.exit_code == 2
    assert "--port" in result.output and "second" in result.output

    # Uninstalling one leaves the other alone; with two installed, --name is needed.
    result = invoke(["uninstall", "launchd"])
    assert result.exit_code == 2 and "--name" in result.output
    assert invoke(["uninstall", "launchd", "--name", "second"]).exit_code == 0
    assert len(list(env.launch_agents.glob("*.plist"))) == 2
    # Now only one is left: the name is found from its manifest.
    assert invoke(["uninstall", "launchd"]).exit_code == 0
    assert list(env.launch_agents.glob("*.plist")) == []


def test_launchd_dry_run_runs_nothing(env, tmp_path):
    port = free_port()
    out = tmp_path / "out"
    result = env.install("launchd", "--dry-run", "--output-dir", str(out), port=port)
    assert result.exit_code == 0, result.output
    assert env.calls() == []
    name = f"mlx-{port}"
    assert tree(out) == sorted([
        f"io.github.mlx-watchdog.{name}.server.plist",
        f"io.github.mlx-watchdog.{name}.watchdog.plist",
        f"{name}.toml", f"{name}.install.json",
    ])
    assert f"would run: launchctl bootstrap gui/{env.uid} {out}/io.github.mlx-watchdog." \
           f"{name}.server.plist" in result.output
    assert not env.launch_agents.exists()
    assert not (env.home / "Library" / "Logs").exists()


def test_server_args_after_double_dash(env):
    port = free_port()
    result = env.install("launchd", "--", "--max-tokens", "64", "--chat-template", "a b",
                         port=port)
    assert result.exit_code == 0, result.output
    plist = load_plist(env.launch_agents / f"io.github.mlx-watchdog.mlx-{port}.server.plist")
    assert plist["ProgramArguments"][-4:] == ["--max-tokens", "64", "--chat-template", "a b"]


# --------------------------------------------------------------------------
# systemd
# --------------------------------------------------------------------------


def test_systemd_user_install_reinstall_uninstall(env, tmp_path):
    port, name = env.installed("systemd")
    su, wu = f"{name}-server.service", f"{name}-watchdog.service"
    ss = f"{name}-server.socket"
    assert env.calls() == [
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "enable", "--now", ss, su, wu],
    ]
    server = (env.user_units / su).read_text()
    assert f"Requires={ss}\n" in server and f"After={ss}\n" in server
    held = (env.user_units / ss).read_text()
    assert f"ListenStream=127.0.0.1:{port}\n" in held and f"Service={su}\n" in held
    state = env.home / ".local" / "state" / "mlx-watchdog"
    assert f"ExecStart={PYTHON} -m mlx_lm server --model {env.model} --host 127.0.0.1 " \
           f"--port {port}\n" in server
    assert f"Environment=PYTHONPATH={env.shim}\n" in server
    assert f"Environment=MLX_HOTFIX_HEARTBEAT_FILE={state}/{name}.heartbeat\n" in server
    assert f"Environment=MLX_HOTFIX_REPORT_DIR={state}/reports\n" in server
    assert f"Environment=MLX_HOTFIX_REPORT_DIR={state}/reports\n" in (
        env.user_units / wu).read_text()
    assert "HF_HUB_OFFLINE" not in server
    assert state.is_dir()
    config = tomllib.loads((env.user_config / f"{name}.toml").read_text())
    assert config["instances"][name]["restart"] == {"type": "systemd", "unit": su, "user": True}
    assert config["state_file"] == str(state / f"{name}.state.json")

    result = env.install("systemd", "--offline", port=port)  # update in place
    assert result.exit_code == 0, result.output
    assert env.calls() == [
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "enable", ss, su, wu],
        ["systemctl", "--user", "restart", ss, su, wu],
    ]
    assert "Environment=HF_HUB_OFFLINE=1\n" in (env.user_units / su).read_text()

    (env.user_units / "other.service").write_text("[Service]\nExecStart=/bin/true\n")
    result = invoke(["uninstall", "systemd", "--name", name])
    assert result.exit_code == 0, result.output
    assert env.calls() == [
        ["systemctl", "--user", "cat", ss],
        ["systemctl", "--user", "disable", "--now", wu, su, ss],
        ["systemctl", "--user", "daemon-reload"],
    ]
    assert tree(env.user_units) == ["other.service"]
    assert tree(env.user_config) == []


@needs_verify
def test_systemd_units_pass_verify(env, tmp_path):
    port, _ = env.installed("systemd")
    units = sorted(env.user_units.glob("*.service")) + sorted(env.user_units.glob("*.socket"))
    assert len(units) == 3
    systemd_verify(tmp_path, units)
    systemd_verify(tmp_path, units, user=True)


@needs_verify
def test_systemd_quoting_of_awkward_paths_and_args(env, tmp_path):
    # A python (wrapper) and a model in folders with spaces, and server
    # arguments with quotes, $, % and a backslash.
    odd = tmp_path / "my env"
    (odd / "bin").mkdir(parents=True)
    wrapper = odd / "bin" / "python"
    wrapper.write_text(f'#!/bin/sh\nexec "{PYTHON}" "$@"\n')
    wrapper.chmod(0o755)
    model = tmp_path / "my models" / "demo 100%"
    model.mkdir(parents=True)
    port = free_port()
    weird = ['a "quoted" $HOME %n \\x', "plain", ";"]
    result = invoke(["install", "systemd", "--model", str(model), "--port", str(port),
                     "--python", str(wrapper), "--", "--chat-template", *weird])
    assert result.exit_code == 0, result.output
    text = (env.user_units / f"mlx-{port}-server.service").read_text()
    exec_line = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    assert exec_line == (
        f'ExecStart="{wrapper}" -m mlx_lm server --model "{tmp_path}/my models/demo 100%%" '
        f"--host 127.0.0.1 --port {port} --chat-template "
        '"a \\"quoted\\" $$HOME %%n \\\\x" plain \\;'
    )
    systemd_verify(tmp_path, sorted(env.user_units.glob("*.service")))


@needs_verify
def test_systemd_system_units(env, tmp_path):
    port = free_port()
    out = tmp_path / "etc-systemd"
    user = "daemon"  # exists on Debian and macOS; "nobody" makes verify warn
    try:
        import pwd

        pwd.getpwnam(user)
    except (ImportError, KeyError):
        pytest.skip(f"no user {user!r} here")
    result = env.install("systemd", "--system", "--user-name", user, "--output-dir", str(out),
                         "--dry-run", port=port)
    assert result.exit_code == 0, result.output
    assert env.calls() == []
    name = f"mlx-{port}"
    assert "would run: systemctl daemon-reload" in result.output
    assert f"would run: systemctl enable --now {out}/{name}-server.socket " \
           f"{out}/{name}-server.service {out}/{name}-watchdog.service" in result.output
    server = (out / f"{name}-server.service").read_text()
    watchdog = (out / f"{name}-watchdog.service").read_text()
    assert f"User={user}\n" in server
    assert "StateDirectory=mlx-watchdog\n" in server
    assert "Environment=MLX_HOTFIX_HEARTBEAT_FILE=/var/lib/mlx-watchdog/" in server
    # The root watchdog looks for the stacks and reports where the server's user writes them.
    assert "Environment=MLX_HOTFIX_REPORT_DIR=/var/lib/mlx-watchdog/reports\n" in server
    assert "Environment=MLX_HOTFIX_REPORT_DIR=/var/lib/mlx-watchdog/reports\n" in watchdog
    assert "WantedBy=multi-user.target\n" in server and "WantedBy=multi-user.target\n" in watchdog
    assert "User=" not in watchdog  # root, so that it may restart a system unit
    cfg = tomllib.loads((out / f"{name}.toml").read_text())
    assert cfg["instances"][name]["restart"]["user"] is False
    systemd_verify(tmp_path, [out / f"{name}-server.service", out / f"{name}-watchdog.service",
                              out / f"{name}-server.socket"])


def test_systemd_system_install_in_custom_dir_enables_by_path(env, tmp_path, monkeypatch):
    port = free_port()
    out = tmp_path / "units"
    monkeypatch.setenv("FAKE_SYSTEMD_UNIT_DIR", str(out))
    result = env.install("systemd", "--system", "--output-dir", str(out), port=port)
    assert result.exit_code == 0, result.output
    name = f"mlx-{port}"
    assert env.calls() == [
        ["systemctl", "daemon-reload"],
        ["systemctl", "enable", "--now", str(out / f"{name}-server.socket"),
         str(out / f"{name}-server.service"), str(out / f"{name}-watchdog.service")],
    ]
    result = invoke(["uninstall", "systemd", "--system", "--output-dir", str(out),
                     "--name", name])
    assert result.exit_code == 0, result.output
    assert env.calls() == [
        ["systemctl", "cat", f"{name}-server.socket"],
        ["systemctl", "disable", "--now", f"{name}-watchdog.service", f"{name}-server.service",
         f"{name}-server.socket"],
        ["systemctl", "daemon-reload"],
    ]
    assert tree(out) == []


def test_systemd_enable_failure(env, monkeypatch):
    port = free_port()
    name = f"mlx-{port}"
    result = env.fails_at(monkeypatch, "enable", env.install_argv("systemd", port=port))
    assert "systemctl --user enable --now" in result.output
    assert "Access denied" in result.output
    assert f"mlx-watchdog uninstall systemd --name {name}" in result.output
    assert [c[2] for c in env.calls()] == ["daemon-reload", "enable"]
    assert sorted(p.name for p in env.user_units.iterdir()) == [
        f"{name}-server.service", f"{name}-server.socket", f"{name}-watchdog.service"]
    # Fixed: re-running install completes it.
    env.installed("systemd", port=port)
    assert [c[2] for c in env.calls()] == ["daemon-reload", "enable", "restart"]


def test_systemd_disable_failure_removes_nothing(env, monkeypatch):
    port, _ = env.installed("systemd")
    env.calls()
    result = env.fails_at(monkeypatch, "disable", ["uninstall", "systemd", "--port", str(port)])
    assert "Nothing was removed" in result.output
    assert [c[2] for c in env.calls()] == ["cat", "disable"]
    assert len(list(env.user_units.glob("*.service"))) == 2
    assert len(list(env.user_config.iterdir())) == 2


def test_no_socket_keeps_the_servers_own_bind(env):
    port, name = env.installed("systemd", "--no-socket")
    assert env.calls()[1] == ["systemctl", "--user", "enable", "--now",
                              f"{name}-server.service", f"{name}-watchdog.service"]
    server = (env.user_units / f"{name}-server.service").read_text()
    assert "Requires=" not in server and not (env.user_units / f"{name}-server.socket").exists()
    lport, lname = env.installed("launchd", "--no-socket")
    plist = load_plist(env.launch_agents / f"io.github.mlx-watchdog.{lname}.server.plist")
    assert "Sockets" not in plist and "MLX_HOTFIX_LAUNCHD_SOCKET" not in \
        plist["EnvironmentVariables"]


def test_reinstalling_with_no_socket_removes_the_socket_unit(env):
    port, name = env.installed("systemd")
    env.calls()
    assert env.install("systemd", "--no-socket", port=port).exit_code == 0
    assert env.calls()[:2] == [
        ["systemctl", "--user", "disable", "--now", f"{name}-server.socket"],
        ["systemctl", "--user", "daemon-reload"]]
    assert not (env.user_units / f"{name}-server.socket").exists()


def test_the_held_socket_needs_an_address(env):
    result = env.install("systemd", "--host", "localhost", port=free_port())
    assert result.exit_code == 2
    assert "'localhost' is a name" in result.output and "--no-socket" in result.output
    port, name = env.installed("systemd", "--host", "::1")
    held = (env.user_units / f"{name}-server.socket").read_text()
    assert f"ListenStream=[::1]:{port}\n" in held


def test_systemd_missing_systemctl(env, monkeypatch):
    (env.bin / "systemctl").unlink()
    monkeypatch.setenv("PATH", str(env.bin))
    result = env.install("systemd", port=free_port())
    assert result.exit_code == 1
    assert "systemctl: command not found" in result.output


def test_shared_output_dir_keeps_managers_apart(env, tmp_path):
    out = tmp_path / "out"
    port, _ = env.installed("launchd", "--dry-run", "--output-dir", str(out))
    result = env.install("systemd", "--dry-run", "--output-dir", str(out), port=port)
    _fails_naming(result, "--name")
    assert "installed for launchd" in result.output
    before = tree(out)
    result = invoke(["uninstall", "systemd", "--output-dir", str(out), "--port", str(port)])
    assert result.exit_code == 0
    assert tree(out) == before  # launchd's files are not systemd's to remove


def test_xdg_dirs_are_honoured(env, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "st"))
    monkeypatch.setenv("FAKE_SYSTEMD_UNIT_DIR", str(tmp_path / "cfg" / "systemd" / "user"))
    port, _ = env.installed("systemd")
    assert (tmp_path / "cfg" / "systemd" / "user" / f"mlx-{port}-server.service").exists()
    cfg = tomllib.loads((tmp_path / "cfg" / "mlx-watchdog" / f"mlx-{port}.toml").read_text())
    assert cfg["state_file"] == str(tmp_path / "st" / "mlx-watchdog" / f"mlx-{port}.state.json")
    assert not env.user_units.exists()


def test_refuses_to_overwrite_a_foreign_unit(env):
    port = free_port()
    env.user_units.mkdir(parents=True)
    foreign = env.user_units / f"mlx-{port}-server.service"
    foreign.write_text("[Service]\nExecStart=/bin/true\n")
    result = env.install("systemd", port=port)
    assert result.exit_code == 1
    assert "refusing to overwrite" in result.output
    assert foreign.read_text() == "[Service]\nExecStart=/bin/true\n"
    assert env.calls() == []
    # ... and uninstall does not remove it either.
    result = invoke(["uninstall", "systemd", "--port", str(port)])
    assert result.exit_code == 0
    assert foreign.exists()
    assert "kept" in result.output


def test_shim_dir_comes_from_mlx_watchdog_shim(env):
    port, _ = env.installed("systemd")
    text = (env.user_units / f"mlx-{port}-server.service").read_text()
    assert f"Environment=PYTHONPATH={env.shim}\n" in text


# --------------------------------------------------------------------------
# bad input: each error names its flag
# --------------------------------------------------------------------------


def _fails_naming(result, flag: str) -> None:
    assert result.exit_code == 2, result.output
    assert flag in result.output, result.output


def test_bad_python(env, tmp_path):
    port = str(free_port())
    base = ["install", "systemd", "--model", str(env.model), "--port", port]
    _fails_naming(invoke(base + ["--python", str(tmp_path / "nope" / "python")]), "--python")
    not_exe = tmp_path / "python-not-exe"
    not_exe.write_text("")
    _fails_naming(invoke(base + ["--python", str(not_exe)]), "--python")
    no_mlx = tmp_path / "python-without-mlx"
    no_mlx.write_text("#!/bin/sh\nexit 3\n")
    no_mlx.chmod(0o755)
    result = invoke(base + ["--python", str(no_mlx)])
    _fails_naming(result, "--python")
    assert "mlx_lm" in result.output
    not_python = tmp_path / "not-python"
    not_python.write_text("#!/bin/sh\nexit 1\n")
    not_python.chmod(0o755)
    result = invoke(base + ["--python", str(not_python)])
    _fails_naming(result, "--python")
    assert "does not run as a Python" in result.output
    assert env.calls() == []


def test_port_in_use(env):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        result = env.install("systemd", port=port)
    _fails_naming(result, "--port")
    assert "in use" in result.output
    assert env.calls() == []
    assert not env.user_units.exists()


def test_reinstall_skips_the_port_check_for_its_own_server(env):
    port, _ = env.installed("systemd")
    with socket.socket() as listener:  # our server, now running
        listener.bind(("127.0.0.1", port))
        listener.listen(1)
        env.installed("systemd", port=port)


@pytest.mark.parametrize("port", ["0", "65536", "http"])
def test_port_out_of_range(env, port):
    result = invoke(["install", "systemd", "--model", str(env.model), "--port", port])
    _fails_naming(result, "--port")


def test_host_not_on_this_machine(env):
    result = env.install("systemd", "--host", "192.0.2.1", port=free_port())
    _fails_naming(result, "--host")


def test_missing_local_model(env, tmp_path):
    for model in [str(tmp_path / "no-such-model"), "./no-such-model", "~/no-such-model"]:
        result = env.install("systemd", port=free_port(), model=model)
        _fails_naming(result, "--model")
    assert env.calls() == []


def test_relative_model_is_made_absolute(env, monkeypatch):
    monkeypatch.chdir(env.model.parent)
    port = free_port()
    assert env.install("systemd", port=port, model="./demo").exit_code == 0
    assert f"--model {env.model} " in (env.user_units / f"mlx-{port}-server.service").read_text()


def test_hf_repo_id_only_warns(env):
    port = free_port()
    result = env.install("systemd", port=port, model="mlx-community/Qwen3-0.6B-4bit")
    assert result.exit_code == 0, result.output
    assert "warning" in result.output and "--model" in result.output
    text = (env.user_units / f"mlx-{port}-server.service").read_text()
    assert "--model mlx-community/Qwen3-0.6B-4bit " in text


@pytest.mark.parametrize(
    "name", ["", "a b", "x/y", "-lead", ".hidden", "_under", "a@b", "a:b", "é", "a" * 65])
def test_bad_name(env, name):
    _fails_naming(env.install("systemd", "--name", name, port=free_port()), "--name")


def test_dotted_name_is_a_quoted_toml_key(env):
    port, _ = env.installed("systemd", "--name", "qwen.8b")
    cfg = tomllib.loads((env.user_config / "qwen.8b.toml").read_text())
    assert list(cfg["instances"]) == ["qwen.8b"]


def test_flag_combinations(env):
    port = free_port()
    _fails_naming(env.install("launchd", "--system", port=port), "--system")
    _fails_naming(env.install("systemd", "--user-name", "daemon", port=port), "--user-name")
    _fails_naming(env.install("systemd", "--system", "--user-name", "no-such-user-xyz",
                              "--dry-run", port=port), "--user-name")
    _fails_naming(invoke(["install", "systemd", "--port", str(port)]), "--model")
    _fails_naming(env.install("systemd", "--shim-dir", str(env.tmp), port=port), "--shim-dir")
    _fails_naming(invoke(["uninstall", "launchd", "--system"]), "--system")
    _fails_naming(invoke(["uninstall", "systemd", "--name", "a/b"]), "--name")
    assert env.calls() == []


def test_missing_drop_in_names_shim_dir(env, monkeypatch):
    def missing():
        raise FileNotFoundError("the hotfix drop-in folder is missing")

    monkeypatch.setattr(shim, "shim_dir", missing)
    _fails_naming(env.install("systemd", port=free_port()), "--shim-dir")


def test_uninstall_with_nothing_installed(env):
    result = invoke(["uninstall", "systemd", "--name", "ghost"])
    assert result.exit_code == 0
    assert "nothing installed" in result.output
    assert env.calls() == []
    _fails_naming(invoke(["uninstall", "systemd"]), "--name")


def test_real_drop_in_folder_is_the_default(env, monkeypatch):
    monkeypatch.setattr(shim, "shim_dir", REAL_SHIM_DIR)
    try:
        real = shim.shim_dir()
    except FileNotFoundError:
        pytest.skip("the drop-in folder is not there yet")
    port, _ = env.installed("systemd")
    text = (env.user_units / f"mlx-{port}-server.service").read_text()
    assert systemd.environment_line("PYTHONPATH", str(real)) + "\n" in text


def test_generated_configs_load_in_the_watch_config_parser(env):
    from mlx_watchdog import config
    port, _ = env.installed("systemd", "--name", "qwen.8b")
    env.installed("launchd", "--name", "qwen.8b", port=port)
    paths = [env.user_config / "qwen.8b.toml", env.support / "qwen.8b.toml"]
    for rel in reference.reference_files():
        if rel.endswith(".toml"):
            paths.append(REPO / rel)
    for path in paths:
        loaded = config.load_config(str(path))
        (inst,) = loaded.instances
        assert inst.model == "default_model"
        assert inst.heartbeat_file and loaded.state_file
        assert inst.restart.type in ("launchd", "systemd")
    # The watchdog definition's own command accepts its config.
    argv = load_plist(env.launch_agents / "io.github.mlx-watchdog.qwen.8b.watchdog.plist")[
        "ProgramArguments"]
    proc = subprocess.run(argv + ["--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "qwen.8b" in proc.stdout


# --------------------------------------------------------------------------
# pure rendering, reference files, entry points
# --------------------------------------------------------------------------


def test_quote_exec_arg():
    q = systemd.quote_exec_arg
    assert q("/usr/bin/python") == "/usr/bin/python"
    assert q("a b") == '"a b"'
    assert q("100%") == "100%%"
    assert q("$x") == '"$$x"'
    assert q('say "hi"\\') == '"say \\"hi\\"\\\\"'
    assert q(";") == "\\;"
    assert q("") == '""'
    with pytest.raises(ValueError):
        q("a\nb")
    with pytest.raises(ValueError):
        systemd.exec_line(["python", "-V"])
    assert systemd.environment_line("A", "x y%") == 'Environment="A=x y%%"'


def test_probe_url():
    assert instance.probe_url("0.0.0.0", 8080) == "http://127.0.0.1:8080"
    assert instance.probe_url("::", 8080) == "http://[::1]:8080"
    assert instance.probe_url("::1", 8080) == "http://[::1]:8080"
    assert instance.probe_url("localhost", 1) == "http://localhost:1"


def test_reference_files_match_the_code():
    problems = reference.reference_drift(REPO)
    assert problems == [], (
        "launchd/ or systemd/ drifted from the code; run scripts/write-service-reference:\n"
        + "\n".join(problems))


def test_reference_files_parse():
    files = reference.reference_files()
    for rel, data in files.items():
        if rel.endswith(".plist"):
            assert plistlib.loads(data)["Label"] + ".plist" == Path(rel).name
        elif rel.endswith(".toml"):
            tomllib.loads(data.decode())
    assert b"/opt/mlx/bin/python" in files["systemd/mlx-8080-server.service"]


def test_python_dash_m_entry_points(tmp_path):
    # `python -m mlx_watchdog.cli install` must see the command too.
    out = subprocess.run([PYTHON, "-m", "mlx_watchdog.cli", "install", "--help"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "ThrottleInterval" in out.stdout
    check = subprocess.run([PYTHON, "-m", "mlx_watchdog.install.reference", "--check-reference",
                            str(REPO)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    # Drift is detected.
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "launchd", copy / "launchd")
    shutil.copytree(REPO / "systemd", copy / "systemd")
    unit = copy / "systemd" / "mlx-8080-server.service"
    unit.write_text(unit.read_text().replace("WatchdogSec=60", "WatchdogSec=61"))
    check = subprocess.run([PYTHON, "-m", "mlx_watchdog.install.reference", "--check-reference",
                            str(copy)], capture_output=True, text=True)
    assert check.returncode == 1
    assert "differs: systemd/mlx-8080-server.service" in check.stderr


# -- tuning an installed instance (flags, not hand edits the next install loses) ----------


def test_install_flags_tune_the_watchdog_and_the_server(env, tmp_path):
    from mlx_watchdog.config import load_config

    port = free_port()
    out = tmp_path / "out"
    result = env.install(
        "systemd", "--dry-run", "--output-dir", str(out), "--metrics-port", "9464",
        "--metrics-host", "0.0.0.0", "--probe-interval", "2", "--probe-timeout", "20",
        "--failures", "4", "--boot-grace", "120", "--heartbeat-timeout", "30",
        "--max-busy", "0", "--stop-grace", "45",
        "--env", "MLX_HOTFIX_STALL_TIMEOUT=60", "--env", "MLX_HOTFIX_RECOVER=thread",
        port=port)
    assert result.exit_code == 0, result.output
    name = f"mlx-{port}"
    config = load_config(out / f"{name}.toml")  # what `watch` reads, validated
    assert (config.metrics_port, config.metrics_host) == (9464, "0.0.0.0")
    (inst,) = config.instances
    assert (inst.interval, inst.timeout, inst.failures, inst.boot_grace) == (2, 20, 4, 120)
    assert (inst.heartbeat_timeout, inst.max_busy, inst.stop_grace) == (30, 0, 45)
    unit = (out / f"{name}-server.service").read_text()
    assert "Environment=MLX_HOTFIX_STALL_TIMEOUT=60" in unit
    assert "Environment=MLX_HOTFIX_RECOVER=thread" in unit
    assert f"Environment=MLX_HOTFIX_INSTANCE={name}" in unit
    # A dry run shows what an install would say: logs, linger, how to check it.
    assert "logs: journalctl --user" in result.output
    assert "check it: mlx-watchdog status" in result.output
    assert "metrics: http://0.0.0.0:9464/metrics" in result.output
    systemd_verify(tmp_path, [out / f"{name}-server.service"], user=True)


def test_install_env_flag_is_checked(env):
    port = free_port()
    bad = env.install("systemd", "--dry-run", "--env", "NOEQUALS", port=port)
    _fails_naming(bad, "--env")
    reserved = env.install("systemd", "--dry-run", "--env", "PYTHONPATH=/x", port=port)
    _fails_naming(reserved, "--env")
    reserved = env.install("launchd", "--dry-run", "--env", "MLX_HOTFIX_LAUNCHD_SOCKET=x",
                           port=port)
    _fails_naming(reserved, "--env")
    # The shim's own list of its variables (read as data from its config module).
    (env.shim / "mlx_hotfix").mkdir()
    (env.shim / "mlx_hotfix" / "config.py").write_text(
        (Path(__file__).resolve().parents[1] / "sitecustomize/mlx_hotfix/config.py").read_text())
    typo = env.install("systemd", "--dry-run", "--output-dir", str(env.tmp / "o"),
                       "--env", "MLX_HOTFIX_STAL_TIMEOUT=5", port=port)
    assert typo.exit_code == 0
    assert "did you mean MLX_HOTFIX_STALL_TIMEOUT?" in typo.output


def test_install_help_comes_from_the_units_constants():
    from mlx_watchdog.install import systemd

    text = invoke(["install", "--help"]).output
    assert "at most 5 starts" not in text
    assert f"StartLimitIntervalSec={systemd.START_LIMIT_INTERVAL_SEC}" in text
    assert f"WatchdogSec={systemd.WATCHDOG_SEC}" in text
    for flag in ("--metrics-port", "--env", "--probe-interval", "--heartbeat-timeout"):
        assert flag in text


def test_launchd_notes_give_a_newsyslog_recipe(env, tmp_path):
    from mlx_watchdog.install import launchd

    port = free_port()
    result = env.install("launchd", "--dry-run", "--output-dir", str(tmp_path / "o"), port=port)
    assert result.exit_code == 0, result.output
    assert f"/etc/newsyslog.d/mlx-watchdog-mlx-{port}.conf" in result.output
    # newsyslog.conf(5): logfilename owner:group mode count size when flags.
    conf = [line.split() for line in result.output.splitlines()
            if line.strip().endswith(".log  " + "x") or line.strip().endswith("NJ")]
    assert len(conf) == 4, result.output
    for fields in conf:
        path, owner, mode, count, size, when, flags = fields
        assert path.endswith(".log") and ":" in owner and mode == "640"
        assert int(count) == launchd.NEWSYSLOG_COUNT and int(size) == launchd.NEWSYSLOG_SIZE_KB
        assert when == "*" and flags == "NJ"
