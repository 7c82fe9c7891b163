"""A group's hosts: mlx.launch's JSON hostfile, host names, and this machine's
own names (which mlx.launch runs without ssh only as 127.0.0.1)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

from .redact import printable
from .safefile import read_regular

LOCAL_HOST = "127.0.0.1"  # the only name mlx.launch runs without ssh


class GroupError(ValueError):
    """A group command or hostfile that cannot work, with a message that says why."""


@dataclass
class Host:
    ssh: str
    ips: List[str] = field(default_factory=list)

    @property
    def local(self) -> bool:
        return self.ssh == LOCAL_HOST


_HOSTFILE_BYTES = 1 << 20


def _read_hostfile(path: "str | os.PathLike[str]") -> object:
    # A regular file only: a FIFO there would block install and doctor.
    return json.loads(read_regular(path, _HOSTFILE_BYTES))


def is_ip(name: str) -> bool:
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
    with contextlib.suppress(OSError):
        names.add(socket.getfqdn())
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
