"""Which rank of a distributed group this process is, and on which host.

``mlx.launch`` starts one server per rank and exports MLX_RANK to each (its
mpi backend goes through mpirun, which sets OMPI_COMM_WORLD_RANK or PMI_RANK).
Heartbeats, stacks and crash reports carry ``identity()`` so that a report
from a group names the rank and host it came from. A process that is not
part of a group has rank None.
"""

import os

_RANK_VARIABLES = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def rank(environ=None):
    """This process's rank (int), or None outside a distributed group."""
    environ = os.environ if environ is None else environ
    for key in _RANK_VARIABLES:
        raw = environ.get(key, "").strip()
        if raw.isascii() and raw.isdigit():  # "²".isdigit() too, which int() refuses
            return int(raw)
    return None


def host():
    try:
        return os.uname().nodename
    except (AttributeError, OSError):
        import socket

        return socket.gethostname()


def identity(environ=None):
    """{"rank": int or None, "host": name}: for heartbeats and reports."""
    return {"rank": rank(environ), "host": host()}


def describe(environ=None):
    """'rank 1 on studio-2', or 'on studio-2' outside a group: for log lines."""
    who = identity(environ)
    if who["rank"] is None:
        return "on %s" % who["host"]
    return "rank %d on %s" % (who["rank"], who["host"])


def heartbeat_path(base, environ=None):
    """Rank 0 (and a lone server) writes the heartbeat file itself; rank N>0
    writes ``<file>.rankN`` next to it, so every local rank has its own and a
    watchdog can judge each one (see mlx_watchdog.group)."""
    if not base:
        return base
    from .contract import rank_file

    return rank_file(base, rank(environ))
