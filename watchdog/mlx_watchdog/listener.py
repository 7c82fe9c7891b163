"""Evidence that the server being judged is the one answering on its port.

A supervised child that could not bind its port (the old process still holds
it, or two services collide) is headless, and a probe of the URL then reaches
the *other* server: its answers say nothing about our child. So, for a URL on
this machine, `ListenerCheck` looks for the listening socket of the URL's
port among the sockets of the judged process and its descendants (psutil's
per-process connections, which need no root, on macOS either). When they do
not hold it and something else does (the system's socket table says so, or
the probe got an answer), it says who.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from typing import Callable, Iterable, List, Optional
from urllib.parse import urlsplit

import psutil

from .probe import UNREACHABLE, ProbeResult


def _local_addresses() -> set:
    addresses = {"localhost", "0.0.0.0", "::"}
    with contextlib.suppress(psutil.Error, OSError):
        for entries in psutil.net_if_addrs().values():
            for entry in entries:
                if entry.family in (socket.AF_INET, socket.AF_INET6):
                    addresses.add(entry.address.split("%", 1)[0])
    with contextlib.suppress(OSError):
        addresses.add(socket.gethostname())
    return addresses


def local_port(url: str) -> Optional[int]:
    """The port of url when its host is this machine, else None."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if host is None:
        return None
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    try:
        if ipaddress.ip_address(host).is_loopback:
            return port
    except ValueError:
        pass
    return port if host in _local_addresses() else None


def _connections(proc: psutil.Process) -> list:
    get = getattr(proc, "net_connections", None) or proc.connections
    return get(kind="inet")


def _listens_on(connections: Iterable, port: int) -> bool:
    return any(
        c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in connections
    )


class ListenerCheck:
    """Who holds the listening socket of url's port: the judged tree, or not.

    root returns the judged process's pid (None: nothing to judge now).
    """

    def __init__(self, url: str, root: Callable[[], Optional[int]]):
        self.port = local_port(url)
        self._root = root
        self._holder: Optional[int] = None  # the pid in the tree seen holding it

    def __call__(self, probe: ProbeResult) -> Optional[str]:
        """None when the tree holds the port, or when no one else is seen to;
        else a sentence saying another process holds it."""
        if self.port is None:
            return None
        root = self._root()
        if root is None:
            return None
        tree = self._tree(root)
        if not tree:
            return None
        if self._tree_listens(tree):
            return None
        others = self._other_listeners(set(p.pid for p in tree))
        if others is None:  # the system table is closed to us (macOS without root)
            if probe.status == UNREACHABLE:
                return None
            return (f"port {self.port} is answered by another process, not by the server "
                    f"(pid {root}), which is not listening")
        if not others:
            return None
        return (f"port {self.port} is held by another process ({', '.join(others)}), "
                f"not by the server (pid {root})")

    def _tree(self, root: int) -> List[psutil.Process]:
        try:
            proc = psutil.Process(root)
        except psutil.Error:
            return []
        try:
            return [proc] + proc.children(recursive=True)
        except psutil.Error:
            return [proc]

    def _tree_listens(self, tree: List[psutil.Process]) -> bool:
        # The holder seen last time first: usually no need to look further.
        ordered = sorted(tree, key=lambda p: p.pid != self._holder)
        for proc in ordered:
            try:
                if _listens_on(_connections(proc), self.port):
                    self._holder = proc.pid
                    return True
            except psutil.AccessDenied:
                return True  # cannot look: do not accuse
            except psutil.Error:
                continue
        return False

    def _other_listeners(self, ours: set) -> Optional[List[str]]:
        try:
            table = psutil.net_connections(kind="inet")
        except (psutil.AccessDenied, OSError):
            return None
        found = []
        for c in table:
            if c.status != psutil.CONN_LISTEN or not c.laddr or c.laddr.port != self.port:
                continue
            if c.pid in ours:
                return []
            found.append(describe_process(c.pid))
        return sorted(set(found))


def describe_process(pid: Optional[int]) -> str:
    if pid is None:
        return "of another user"
    try:
        proc = psutil.Process(pid)
        name = " ".join(proc.cmdline()[:3]) or proc.name()
    except psutil.Error:
        return f"pid {pid}"
    return f"pid {pid}: {name[:80]}"
