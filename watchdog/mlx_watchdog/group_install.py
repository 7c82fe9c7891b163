"""`install --hostfile/--hosts`: the launcher's command line for a group's
service, checked (hosts, backend, reachability) before anything is written."""

from __future__ import annotations

import os
import subprocess
from typing import List, Optional, Tuple

from .group_hosts import GroupError, is_this_machine
from .group_launch import parse_launch
from .group_ssh import Runner, unreachable_hosts


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
