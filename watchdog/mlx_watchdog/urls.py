"""Where a server listens, as a URL to probe.

The one owner of the wildcard-to-loopback mapping: `supervise` reads the URL
from the server's command line, `install` from its flags, `group` for rank 0;
all three must probe the same address for the same bind.
"""

from __future__ import annotations

import os
import re
from typing import Dict, Optional, Sequence

from . import defaults

# A wildcard bind listens on every address; it is reached through loopback.
WILDCARD_HOSTS = {"": "127.0.0.1", "*": "127.0.0.1", "0.0.0.0": "127.0.0.1",
                  "::": "::1", "[::]": "::1"}


def probe_url(host: str, port: int) -> str:
    """http://host:port, a wildcard host mapped to loopback, IPv6 bracketed."""
    host = WILDCARD_HOSTS.get(host, host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{int(port)}"


def bind_host(command: Sequence[str]) -> str:
    """The --host an mlx_lm.server command binds (its own default without one)."""
    return _flags(command)["--host"] or defaults.HOST


def url_from_command(command: Sequence[str]) -> str:
    """The URL an mlx_lm.server command will listen on (--host, --port).

    ValueError when the port cannot be read for sure: a port inside a shell
    string (bash -c "... --port N"), or a command that is not mlx_lm's server
    and has no --port (its default 8080 would only be a guess).
    """
    args = list(command)
    values = _flags(args, strict=True)
    host, port = values["--host"], values["--port"]
    if port is None:
        hidden = [a for a in args if re.search(r"--port\b", a)]
        if hidden:
            raise ValueError(f"cannot read the port from {hidden[0]!r} (inside one argument)")
        if not _runs_mlx_lm_server(args):
            raise ValueError(f"cannot tell which port {args[0]!r} listens on")
        port = str(defaults.PORT)
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"cannot read a port number from --port {port!r}")
    return probe_url(defaults.HOST if host is None else host, int(port))


def flag_value(command: Sequence[str], flag: str) -> Optional[str]:
    """The last value of flag in a command (`--flag V` or `--flag=V`), or None."""
    return _flags(command, names=(flag,))[flag]


def _flags(args: Sequence[str], strict: bool = False,
           names: Sequence[str] = ("--host", "--port")) -> Dict[str, Optional[str]]:
    """The last values of names (`--flag V` or `--flag=V`): --host and --port."""
    values: Dict[str, Optional[str]] = {name: None for name in names}
    for i, arg in enumerate(args):
        for flag in values:
            if arg == flag:
                if i + 1 >= len(args):
                    if strict:
                        raise ValueError(f"{flag} without a value in the command")
                    continue
                values[flag] = args[i + 1]
            elif arg.startswith(flag + "="):
                values[flag] = arg.split("=", 1)[1]
    return values


def _runs_mlx_lm_server(args: Sequence[str]) -> bool:
    """mlx_lm.server, mlx_lm server, python -m mlx_lm.server / mlx_lm server."""
    names = [os.path.basename(a) for a in args[:4]]
    if "mlx_lm.server" in names:
        return True
    return any(a == "mlx_lm" and b == "server" for a, b in zip(names, names[1:]))
