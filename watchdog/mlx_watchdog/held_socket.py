"""The listening socket `supervise` holds for its server, across restarts.

`supervise` binds the server's --host/--port itself, once, before the first
child, and hands the socket to every child by systemd's protocol: fd 3,
LISTEN_FDS=1, LISTEN_PID=<the child's pid>. The hotfix shim in the child
serves on it instead of binding (its `socket` part). While a child restarts,
planned or not, new connections wait in the kernel's backlog and the next
child answers them: nothing is refused.

LISTEN_PID must be the pid of the process that execs the server, which is
known only after the fork. The child is therefore started through a tiny
trampoline (`python -I -S -c TRAMPOLINE fd argv...`: no site, no user
environment for itself) that moves the socket to fd 3, sets LISTEN_PID to its
own pid and execs the server, which keeps that pid. (Moving the fd between
fork and exec in a preexec function is unsafe: fd 3 may be the pipe through
which subprocess reports a failed exec.)
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import sys
from typing import List, Mapping, Sequence

# At least 128 (Linux's and macOS's old SOMAXCONN); the kernel caps it at
# net.core.somaxconn (Linux) or kern.ipc.somaxconn (macOS).
LISTEN_BACKLOG = max(128, socket.SOMAXCONN)

TRAMPOLINE = (
    "import os,sys\n"
    "fd=int(sys.argv[1])\n"
    "if fd!=3:\n"
    " os.dup2(fd,3)\n"
    " os.close(fd)\n"
    "os.environ['LISTEN_FDS']='1'\n"
    "os.environ['LISTEN_PID']=str(os.getpid())\n"
    "os.environ.pop('LISTEN_FDNAMES',None)\n"
    "try:\n"
    " os.execvp(sys.argv[2],sys.argv[2:])\n"
    "except OSError as e:\n"
    " sys.stderr.write('mlx-watchdog: cannot run %r: %s\\n'%(sys.argv[2],e.strerror))\n"
    " os._exit(127)\n"
)


def bind(host: str, port: int, backlog: int = LISTEN_BACKLOG) -> socket.socket:
    """A listening socket on host:port, as mlx_lm.server would bind it
    (the first getaddrinfo answer, SO_REUSEADDR as http.server sets it).
    OSError when it cannot (the port is taken, the address is not ours)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def describe(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def command(argv: Sequence[str], fd: int, env: Mapping[str, str]) -> List[str]:
    """argv, started so that it gets fd as its listening socket (fd 3).

    OSError (ENOENT) when argv[0] cannot be found on env's PATH, as Popen
    would raise for argv itself: the trampoline would only exit 127 later.
    """
    program = argv[0]
    if os.sep in program:
        found = program if os.access(program, os.X_OK) and os.path.isfile(program) else None
    else:
        found = shutil.which(program, path=env.get("PATH", os.defpath))
    if found is None:
        raise OSError(errno.ENOENT, os.strerror(errno.ENOENT), program)
    return [sys.executable, "-I", "-S", "-c", TRAMPOLINE, str(fd), *argv]
