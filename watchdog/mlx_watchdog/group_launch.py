"""An mlx.launch command line, split into its parts (launcher, options, the
server every rank runs, hosts, backend, hostfile)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from .group_hosts import (LOCAL_HOST, GroupError, Host, check_host_name, is_ip, localize_hostfile,
                          read_hosts)
from .urls import WILDCARD_HOSTS, bind_host, url_from_command

LAUNCH_MODULES = ("mlx.launch", "mlx._distributed_utils.launch")

# mlx.launch's own options: flag -> takes a value (mirrors its argparse).
_LAUNCH_OPTIONS = {
    "--print-python": False, "--verbose": False, "--hosts": True, "--repeat-hosts": True,
    "-n": True, "--hostfile": True, "--backend": True, "--env": True, "--mpi-arg": True,
    "--connections-per-ip": True, "--starting-port": True, "-p": True, "--cwd": True,
    "--nccl-port": True, "--python": True,
}


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
        hosts = [Host(name, [name] if is_ip(name) else [])
                 for name in names for _ in range(int(repeat))]
    return LaunchCommand(launcher, options, server, hosts, backend, hostfile)


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
