"""Whether mlx.launch can reach a group's remote hosts: ssh, never prompting."""

from __future__ import annotations

import subprocess
from typing import Callable, List, Sequence

from .group_hosts import check_host_name

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
