"""Distributed groups: an `mlx.launch` command supervised as one server.

`mlx.launch [options] [--] CMD...` starts CMD once per rank (MLX_RANK=N),
on this machine for host 127.0.0.1 and through `ssh -tt HOST` for any other
name; rank 0 answers HTTP. What we learnt from its code (mlx 0.31/0.32,
mlx/_distributed_utils/launch.py) and rely on here:

- Local ranks inherit the launcher's environment, so PYTHONPATH (the shim)
  and MLX_HOTFIX_HEARTBEAT_FILE reach them as they are. Remote ranks get only
  `--env K=V` (and the hostfile's "envs"): the shim's path on those hosts is
  passed that way. But `--env` is exported on every rank, local ones too:
  the PYTHONPATH passed keeps this machine's after the remote shim's path.
- When a rank exits non-zero the launcher terminates the others, logs
  "Node with rank N exited with code C", and then itself exits **0**. A
  service manager that restarts on failure never restarts such a group, so
  `run_group` (under `mlx-watchdog exec`) turns any exit it did not ask for
  into a failure (70 when the launcher said 0).
- SIGTERM kills the launcher at once (it installs no handler) and leaves the
  ranks running. Every rank and every `ssh -tt` client is in the launcher's
  process group, so the group is stopped with killpg: local ranks die, and a
  remote rank loses its pty, whose hangup (SIGHUP) ends it.

Per-rank evidence: rank N>0 writes its heartbeat to `<file>.rankN` (the
shim's mlx_hotfix.group). `GroupHeartbeat` reads every rank's file present
here and hands the judge the worst one, so a rank that hangs, or that waits
in a collective for a rank that hangs, is a hang of the group, not a busy
server. Remote ranks' files stay on their hosts; their hang shows here as
rank 0 stalling in the next collective.
"""

from __future__ import annotations

import glob
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from . import contract, defaults
from .heartbeat import HeartbeatReading, HeartbeatTracker, read_record
from .redact import printable
from .safefile import read_regular
from .urls import WILDCARD_HOSTS, bind_host, url_from_command

LAUNCH_MODULES = ("mlx.launch", "mlx._distributed_utils.launch")
LOCAL_HOST = "127.0.0.1"  # the only name mlx.launch runs without ssh
GROUP_FAILED_EXIT = defaults.SHIM_EXIT_CODE
REMOTE_SHIM_ENV = "MLX_WATCHDOG_REMOTE_SHIM"

# mlx.launch's own options: flag -> takes a value (mirrors its argparse).
_LAUNCH_OPTIONS = {
    "--print-python": False, "--verbose": False, "--hosts": True, "--repeat-hosts": True,
    "-n": True, "--hostfile": True, "--backend": True, "--env": True, "--mpi-arg": True,
    "--connections-per-ip": True, "--starting-port": True, "-p": True, "--cwd": True,
    "--nccl-port": True, "--python": True,
}


class GroupError(ValueError):
    """A group command or hostfile that cannot work, with a message that says why."""


@dataclass
class Host:
    ssh: str
    ips: List[str] = field(default_factory=list)

    @property
    def local(self) -> bool:
        return self.ssh == LOCAL_HOST


@dataclass
class LaunchCommand:
    """An mlx.launch command line, split into its parts."""

    launcher: List[str]  # how the launcher is run: [mlx.launch] or [python, -m, mlx.launch]
    options: List[str]  # the launcher's own options, as given
    server: List[str]  # the command every rank runs
    hosts: List[Host]
    backend: Optional[str]
    hostfile: Optional[str]

    @property
    def argv(self) -> List[str]:
        return [*self.launcher, *self.options, "--", *self.server]

    @property
    def remote_hosts(self) -> List[str]:
        seen: List[str] = []
        for host in self.hosts:
            if not host.local and host.ssh not in seen:
                seen.append(host.ssh)
        return seen

    @property
    def local_ranks(self) -> List[int]:
        return [rank for rank, host in enumerate(self.hosts) if host.local]

    def launch_env(self) -> Dict[str, str]:
        """The launcher's own `--env K=V` assignments (what remote ranks get)."""
        found: Dict[str, str] = {}
        for i, arg in enumerate(self.options):
            if arg == "--env" and i + 1 < len(self.options):
                assignment = self.options[i + 1]
            elif arg.startswith("--env="):
                assignment = arg[len("--env="):]
            else:
                continue
            key, _, value = assignment.partition("=")
            found[key] = value
        return found

    def with_env(self, assignments: Mapping[str, str]) -> "LaunchCommand":
        """The same command with `--env K=V` added (reaches remote ranks)."""
        extra: List[str] = []
        for key, value in assignments.items():
            extra += ["--env", f"{key}={value}"]
        return LaunchCommand(self.launcher, self.options + extra, self.server, self.hosts,
                             self.backend, self.hostfile)

    def probe_url(self) -> str:
        """Rank 0's HTTP address: the server's --host/--port; a loopback or
        wildcard bind on a remote rank 0 is reached at that host's address."""
        url = url_from_command(self.server)
        rank0 = self.hosts[0] if self.hosts else Host(LOCAL_HOST)
        if rank0.local:
            return url
        host = bind_host(self.server)
        if host in WILDCARD_HOSTS or host in ("127.0.0.1", "localhost", "::1"):
            address = rank0.ips[0] if rank0.ips else rank0.ssh.rsplit("@", 1)[-1]
            if ":" in address:
                address = f"[{address}]"
            return re.sub(r"^http://[^/]+:", f"http://{address}:", url)
        return url


def _launcher_prefix(argv: Sequence[str]) -> Optional[int]:
    """How many leading words run the launcher, or None if argv is not mlx.launch."""
    if not argv:
        return None
    if os.path.basename(argv[0]) == "mlx.launch":
        return 1
    # python -m mlx.launch (python, python3, python3.11, a venv path...)
    if re.fullmatch(r"python[0-9.]*", os.path.basename(argv[0])):
        if len(argv) >= 3 and argv[1] == "-m" and argv[2] in LAUNCH_MODULES:
            return 3
        if len(argv) >= 2 and argv[1] in tuple("-m" + m for m in LAUNCH_MODULES):
            return 2
    return None


def is_launch_command(argv: Sequence[str]) -> bool:
    return _launcher_prefix(argv) is not None


def parse_launch(argv: Sequence[str], *, read_hostfile: bool = True) -> Optional[LaunchCommand]:
    """The parts of an mlx.launch command; None for any other command.

    GroupError when it is mlx.launch but cannot serve (no server command, a
    bad hostfile).
    """
    prefix = _launcher_prefix(argv)
    if prefix is None:
        return None
    launcher, rest = list(argv[:prefix]), list(argv[prefix:])
    options: List[str] = []
    values: Dict[str, List[str]] = {}
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg == "--":
            i += 1
            break
        flag, has_inline, inline = arg.partition("=")
        if flag in _LAUNCH_OPTIONS and arg.startswith("-"):
            if _LAUNCH_OPTIONS[flag] and not has_inline:
                if i + 1 >= len(rest):
                    raise GroupError(f"mlx.launch option {flag} needs a value")
                values.setdefault(flag, []).append(rest[i + 1])
                options += [arg, rest[i + 1]]
                i += 2
            else:
                values.setdefault(flag, []).append(inline)
                options.append(arg)
                i += 1
            continue
        break  # the first word that is not a launcher option starts the command
    server = rest[i:]
    if not server:
        raise GroupError("mlx.launch is given no command to run on each rank "
                         "(expected: mlx.launch [options] -- python -m mlx_lm server ...)")
    hostfile = (values.get("--hostfile") or [None])[-1]
    backend = (values.get("--backend") or [None])[-1]
    if hostfile is not None and read_hostfile:
        hosts, file_backend = read_hosts(hostfile)
        backend = backend or file_backend
    elif hostfile is not None:
        hosts = []
    else:
        repeat = (values.get("-n") or values.get("--repeat-hosts") or ["1"])[-1]
        if not repeat.isdigit() or int(repeat) < 1:
            raise GroupError(f"mlx.launch -n {repeat!r}: expected a positive number")
        names = (values.get("--hosts") or [LOCAL_HOST])[-1].split(",")
        if any(not name for name in names):
            raise GroupError("mlx.launch --hosts has an empty host name")
        for name in names:
            check_host_name(name, "mlx.launch --hosts")
        hosts = [Host(name, [name] if _is_ip(name) else [])
                 for name in names for _ in range(int(repeat))]
    return LaunchCommand(launcher, options, server, hosts, backend, hostfile)


_HOSTFILE_BYTES = 1 << 20


def _read_hostfile(path: "str | os.PathLike[str]") -> object:
    # A regular file only: a FIFO there would block install and doctor.
    return json.loads(read_regular(path, _HOSTFILE_BYTES))


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def read_hosts(path: "str | os.PathLike[str]") -> Tuple[List[Host], Optional[str]]:
    """The hosts (rank order) and backend of an mlx.launch JSON hostfile."""
    try:
        data = _read_hostfile(path)
    except FileNotFoundError:
        raise GroupError(f"hostfile {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise GroupError(f"hostfile {path} is not readable JSON: {exc}") from None
    backend = None
    if isinstance(data, dict):
        backend = data.get("backend") or None
        data = data.get("hosts")
    if not isinstance(data, list) or not data:
        raise GroupError(f"hostfile {path}: expected a list of hosts "
                         '(or {"hosts": [...]}), each {"ssh": NAME, "ips": [...]}')
    hosts = []
    for rank, entry in enumerate(data):
        if not isinstance(entry, dict) or not isinstance(entry.get("ssh"), str) \
                or not entry["ssh"]:
            raise GroupError(f"hostfile {path}: host {rank} has no \"ssh\" name")
        ips = entry.get("ips") or []
        if not isinstance(ips, list) or not all(isinstance(ip, str) for ip in ips):
            raise GroupError(f"hostfile {path}: host {rank} \"ips\" must be a list of strings")
        hosts.append(Host(check_host_name(entry["ssh"], f"hostfile {path}: host {rank}"),
                          list(ips)))
    return hosts, backend


def check_host_name(name: str, where: str) -> str:
    """name, or GroupError: a host name that starts with "-" is read by ssh
    as an option (-oProxyCommand=... runs a command here), by mlx.launch and
    by our own checks alike."""
    if name.startswith("-"):
        raise GroupError(
            f"{where}: host name {printable(name)!r} starts with '-', which ssh reads as "
            "an option, not a host; give the host's name or address (user@host works)")
    return name


# -- this machine's names -------------------------------------------------------------


def local_names() -> List[str]:
    names = {"localhost", "127.0.0.1", "::1", socket.gethostname()}
    try:
        names.add(socket.getfqdn())
    except OSError:
        pass
    return sorted(n for n in names if n)


def is_this_machine(name: str) -> bool:
    bare = name.rsplit("@", 1)[-1]
    if bare in local_names():
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


def localize_hostfile(path: "str | os.PathLike[str]", out: "str | os.PathLike[str]") -> bool:
    """Write a copy of the hostfile in which this machine's names (localhost,
    its hostname, a loopback address) read 127.0.0.1, the one name mlx.launch
    runs without ssh. True if anything changed (then use `out`)."""
    data = _read_hostfile(path)
    entries = data.get("hosts") if isinstance(data, dict) else data
    changed = False
    for entry in entries or []:
        if isinstance(entry, dict) and isinstance(entry.get("ssh"), str) \
                and entry["ssh"] != LOCAL_HOST and is_this_machine(entry["ssh"]):
            entry["ssh"] = LOCAL_HOST
            changed = True
    if changed:
        Path(out).write_text(json.dumps(data, indent=1) + "\n")
    return changed


def localized(command: LaunchCommand, private_dir: "str | os.PathLike[str]") -> LaunchCommand:
    """The command with its hostfile localized (see localize_hostfile), if needed."""
    if command.hostfile is None:
        return command
    out = Path(private_dir) / "hostfile.json"
    if not localize_hostfile(command.hostfile, out):
        return command
    options = list(command.options)
    for i, arg in enumerate(options):
        if arg == "--hostfile" and i + 1 < len(options):
            options[i + 1] = str(out)
        elif arg.startswith("--hostfile="):
            options[i] = f"--hostfile={out}"
    hosts, _ = read_hosts(out)
    return LaunchCommand(command.launcher, options, command.server, hosts, command.backend,
                         str(out))


# -- reachability and doctor ----------------------------------------------------------

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


def ssh_check_argv(host: str, remote_command: str = "true") -> List[str]:
    """How we reach a host: as mlx.launch does (ssh), but never prompting.
    `--` ends ssh's options: the host is never read as one."""
    return ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "LogLevel=QUIET",
            "--", check_host_name(host, "ssh"), remote_command]


def unreachable_hosts(hosts: Sequence[str], *, run: Runner = subprocess.run,
                      timeout: float = 15.0) -> List[str]:
    """Problems reaching each remote host by ssh, one line per host ([] when all answer)."""
    problems = []
    for host in hosts:
        try:
            result = run(ssh_check_argv(host), capture_output=True, text=True, timeout=timeout)
        except FileNotFoundError:
            return [f"ssh is not installed: mlx.launch needs it to reach {', '.join(hosts)}"]
        except subprocess.TimeoutExpired:
            problems.append(f"{host}: ssh did not answer within {timeout:g}s")
            continue
        if result.returncode != 0:
            why = (result.stderr or "").strip().splitlines()
            problems.append(
                f"{host}: not reachable by `ssh -o BatchMode=yes {host}` (exit "
                f"{result.returncode}{': ' + why[-1] if why else ''}); mlx.launch reaches "
                "every host but 127.0.0.1 by ssh, without a password prompt: set up key "
                "login, or name this machine 127.0.0.1")
    return problems


# -- per-rank heartbeats --------------------------------------------------------------


def rank_heartbeat_files(path: "str | os.PathLike[str]") -> List[str]:
    """The heartbeat files of ranks N>0 next to rank 0's (`<path>.rankN`, the
    contract's rank_file)."""
    pattern = glob.escape(str(path)) + ".rank*"
    return sorted(p for p in glob.glob(pattern) if contract.RANK_FILE.search(p))


def clear_heartbeats(path: "str | os.PathLike[str]") -> None:
    """Remove every rank's heartbeat (a new group starts): an old one would look stale."""
    for file in [str(path), *rank_heartbeat_files(path)]:
        try:
            os.unlink(file)
        except OSError:
            pass


class GroupHeartbeat:
    """A HeartbeatTracker over every rank's file; sample() returns the worst.

    For a lone server only the one file exists and this is a HeartbeatTracker.
    The worst reading: a rank whose own record says it stalled, else the
    oldest beat. So a rank that stops beating makes the group's heartbeat
    stale, whatever the others do. Owned by one thread, as HeartbeatTracker;
    `accepted` covers every rank.
    """

    def __init__(self, path: "str | os.PathLike[str]", **tracker_options):
        self.path = path
        self._options = tracker_options
        self._trackers: Dict[str, HeartbeatTracker] = {}
        self.accepted: Dict[str, int] = {}

    def sample(self) -> Optional[HeartbeatReading]:
        return self.observe(read_record(self.path))

    def observe(self, record: Optional[dict]) -> Optional[HeartbeatReading]:
        """The worst reading, rank 0's from record (read by the caller), the
        other ranks' read here."""
        files = [str(self.path), *rank_heartbeat_files(self.path)]
        for file in files:
            if file not in self._trackers:
                self._trackers[file] = HeartbeatTracker(file, **self._options)
        rank0, *others = self._trackers.values()
        readings = [r for r in (rank0.observe(record), *(t.sample() for t in others))
                    if r is not None]
        accepted: Dict[str, int] = {}
        for tracker in self._trackers.values():
            accepted.update(tracker.accepted)
        self.accepted = accepted
        if not readings:
            return None
        return max(readings, key=lambda r: (r.phase not in ("loading", "serving"), r.age_s))

    @property
    def problem(self) -> Optional[str]:
        """Why a rank's heartbeat was not used, if one was not (the first found)."""
        problems = [t.problem for t in self._trackers.values() if t.problem]
        return problems[0] if problems else None

    def reset(self) -> None:
        self._trackers.clear()
        self.accepted = {}


def heartbeat_tracker(path: "str | os.PathLike[str]", **options) -> GroupHeartbeat:
    return GroupHeartbeat(path, **options)


# -- running a group under a service manager (mlx-watchdog exec) ----------------------


def prepare(argv: Sequence[str], env: Dict[str, str], *, private_dir: "str | os.PathLike[str]",
            remote_shim_path: Optional[str] = None, shim: bool = True
            ) -> Optional[LaunchCommand]:
    """For supervise and exec: the group command as it should run, or None if
    argv is not mlx.launch. Local host names in the hostfile become 127.0.0.1;
    remote ranks get the shim (`--env PYTHONPATH=`, at remote_shim_path, by
    default the same path as here, followed by this machine's PYTHONPATH for
    the local ranks) and the shim's settings.
    GroupError when it cannot run."""
    command = parse_launch(argv)
    if command is None:
        return None
    command = localized(command, private_dir)
    if not command.remote_hosts:
        return command
    # The shim's settings, but not the heartbeat file nor the report folder:
    # their folders are on this host (a remote rank writes its reports into
    # its own host's default folder). What the command itself passes with
    # --env stands (it comes first: ours would win), but the shim goes in
    # front of its PYTHONPATH.
    own = command.launch_env()
    local_only = (defaults.HEARTBEAT_ENV, defaults.REPORT_DIR_ENV)
    forwarded = {k: v for k, v in env.items()
                 if ((k.startswith(contract.ENV_PREFIX) and k not in local_only)
                     or k == "HF_HUB_OFFLINE") and k not in own}
    if not shim:
        return command.with_env(forwarded)
    shim_folder = remote_shim_path or env.get(REMOTE_SHIM_ENV)
    if shim_folder is None:
        from .shim import shim_dir

        try:
            shim_folder = str(shim_dir())
        except FileNotFoundError:
            shim_folder = None
    if shim_folder:
        # mlx.launch exports --env for every rank, local ones too: so this
        # PYTHONPATH ends with this machine's own (its shim first), which a
        # local rank would otherwise lose. A folder missing on a host is
        # skipped there; the first shim found runs.
        entries = [shim_folder, *own.get("PYTHONPATH", "").split(":"),
                   *env.get("PYTHONPATH", "").split(os.pathsep)]
        path = ":".join(dict.fromkeys(e for e in entries if e))  # ':' on macOS and Linux
        forwarded = {"PYTHONPATH": path, **forwarded}
    return command.with_env(forwarded)


def run_group(argv: Sequence[str], env: Mapping[str, str], *,
              stop_grace_s: float = defaults.STOP_GRACE_S,
              out=sys.stderr) -> int:
    """Run an mlx.launch group until it ends; the status a service manager should see.

    The launcher runs in its own process group. SIGTERM, SIGINT or SIGHUP to
    us stops that whole group (every local rank, every ssh client), SIGKILL
    after stop_grace_s; then we exit 0. An end we did not ask for is a
    failure: mlx.launch exits 0 after a rank died, so that becomes 70.
    """
    heartbeat = env.get(defaults.HEARTBEAT_ENV)
    if heartbeat:
        clear_heartbeats(heartbeat)
    try:
        launcher = subprocess.Popen(list(argv), env=dict(env), start_new_session=True)
    except OSError as exc:
        print(f"mlx-watchdog: cannot run {argv[0]!r}: {exc.strerror or exc}", file=out)
        return 127
    asked: List[int] = []

    def stop(signum, _frame):
        asked.append(signum)
        _signal_group(launcher.pid, signal.SIGTERM)

    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, stop) for sig in handled}
    try:
        while True:
            try:
                code = launcher.wait(timeout=0.5 if not asked else stop_grace_s)
                break
            except subprocess.TimeoutExpired:
                if asked:
                    _signal_group(launcher.pid, signal.SIGKILL)
    finally:
        # Nothing of the group outlives it: a rank the launcher left behind
        # (it leaves them all when it is killed) goes with it.
        _signal_group(launcher.pid, signal.SIGTERM)
        for _ in range(int(min(stop_grace_s, 5.0) / 0.1)):
            if not _group_alive(launcher.pid):
                break
            time.sleep(0.1)
        _signal_group(launcher.pid, signal.SIGKILL)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if asked:
        return 0
    if code == 0:
        print(f"mlx-watchdog: mlx.launch exited 0, but a serving group never ends by itself "
              f"(a rank died: see 'Node with rank N exited' above); exiting "
              f"{GROUP_FAILED_EXIT} so the service manager restarts the group", file=out)
        return GROUP_FAILED_EXIT
    return code if code > 0 else 128 - code


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
        if sig != signal.SIGKILL:
            os.killpg(pgid, signal.SIGCONT)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """A live (not zombie) process is left in the group. Zombies do not count:
    they are dead, and an init that does not reap would keep them forever."""
    import psutil

    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return False


# -- install launchd|systemd for a group ----------------------------------------------


def launcher_for(python: str) -> str:
    """The mlx.launch script of the server's Python (its shebang is that Python)."""
    script = os.path.join(os.path.dirname(python), "mlx.launch")
    if not (os.path.isfile(script) and os.access(script, os.X_OK)):
        raise GroupError(f"{script} does not exist: the server's Python needs mlx with its "
                         "mlx.launch script (pip install mlx)")
    return script


def install_options(*, python: str, hostfile: Optional[str], hosts: Optional[str],
                    backend: Optional[str], run: Runner = subprocess.run
                    ) -> Optional[Tuple[str, ...]]:
    """For `install --hostfile/--hosts`: the launcher's command line
    (mlx.launch and its options), or None for a lone server. GroupError names
    what is wrong: both given, a bad hostfile, a host mlx.launch cannot reach
    (ssh BatchMode; this machine's own names are fine, they run locally)."""
    if hostfile is None and hosts is None:
        if backend is not None:
            raise GroupError("--backend needs --hostfile or --hosts (the group's hosts)")
        return None
    if hostfile is not None and hosts is not None:
        raise GroupError("give --hostfile or --hosts, not both")
    options: List[str] = [launcher_for(python)]
    if hostfile is not None:
        hostfile = os.path.abspath(os.path.expanduser(hostfile))
        options += ["--hostfile", hostfile]
    else:
        options += ["--hosts", hosts]  # type: ignore[list-item]
    if backend is not None:
        options += ["--backend", backend]
    command = parse_launch([*options, "--", python, "-m", "mlx_lm", "server"])
    assert command is not None
    if len(command.hosts) < 2:
        raise GroupError("a group needs at least two ranks (hosts); for one host "
                         "install a plain server")
    if (command.backend or "ring") == "ring":
        missing = [h.ssh for h in command.hosts if not h.ips and not is_this_machine(h.ssh)]
        if missing:
            raise GroupError(f"the ring backend needs IP addresses for every host: "
                             f"{', '.join(missing)} has none (add \"ips\" in the hostfile)")
    remote = [h for h in command.remote_hosts if not is_this_machine(h)]
    problems = unreachable_hosts(remote, run=run)
    if problems:
        raise GroupError("mlx.launch cannot reach every host of the group:\n  "
                         + "\n  ".join(problems))
    return tuple(options)
