"""The listening socket this server process was given, if any: systemd's
protocol (LISTEN_FDS, LISTEN_PID, fd 3), or launchd's (a ``Sockets`` entry
of the job, fetched with ``launch_activate_socket``).

Whoever owns the socket (``mlx-watchdog supervise``, a systemd ``.socket``
unit, a launchd job's ``Sockets``) keeps it listening while the server
restarts: connections that arrive meanwhile wait in the kernel's backlog and
the next server process takes them. Nothing is refused across a restart.

``take()`` is called where the server would bind (patches/held_socket.py).
It answers None when nothing was passed (the server binds as stock does),
the socket when one was, and raises InheritedSocketError when what was
passed is wrong: a closed fd, not a socket, not TCP, not listening. That is
never a reason to bind elsewhere, silently.
"""

import os
import socket
import stat
import sys

SYSTEMD_FIRST_FD = 3  # SD_LISTEN_FDS_START
_SYSTEMD_VARIABLES = ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")


class InheritedSocketError(Exception):
    """What was passed as the listening socket cannot be served on."""


class HeldSocket(socket.socket):
    """An inherited listening socket: its owner set the backlog, and the
    server's own listen(5) must not shrink it."""

    def listen(self, *args):
        pass


def take(environ=None, launchd_name=None, launchd=None):
    """(socket, where it came from), or None when this process was given none.

    environ: os.environ by default; the LISTEN_* variables are removed from it
    once they were ours, so that a process the server starts does not take
    them for its own (as sd_listen_fds(unset_environment=1)).
    launchd_name: the job's Sockets key (MLX_HOTFIX_LAUNCHD_SOCKET).
    """
    environ = os.environ if environ is None else environ
    if environ.get("LISTEN_FDS") is not None:
        return _from_systemd(environ)
    if launchd_name:
        fds = launchd_sockets(launchd_name, launchd)
        source = "launchd (Sockets entry %r)" % launchd_name
        if len(fds) != 1:
            raise InheritedSocketError(
                "%s: %d sockets; mlx_lm.server serves exactly one: give the entry one "
                "address (SockNodeName and SockFamily)" % (source, len(fds)))
        return check(fds[0], source), source
    return None


def _from_systemd(environ):
    raw_count, raw_pid = environ.get("LISTEN_FDS", ""), environ.get("LISTEN_PID", "")
    if raw_pid.strip() != str(os.getpid()):
        from . import log

        log.say("LISTEN_FDS is set for process %s, not this one (pid %d): binding the "
                "server's own --host/--port" % (raw_pid or "(none)", os.getpid()))
        return None
    for key in _SYSTEMD_VARIABLES:
        environ.pop(key, None)
    try:
        count = int(raw_count.strip())
    except ValueError:
        count = -1
    if count != 1:
        raise InheritedSocketError(
            "LISTEN_FDS=%s: mlx_lm.server serves exactly one listening socket; pass it "
            "one (fd %d)" % (raw_count, SYSTEMD_FIRST_FD))
    source = "systemd's protocol (LISTEN_FDS, fd %d)" % SYSTEMD_FIRST_FD
    return check(SYSTEMD_FIRST_FD, source), source


def check(fd, source):
    """fd as a HeldSocket, if it is a listening TCP socket; else InheritedSocketError."""
    where = "%s: fd %d" % (source, fd)
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        raise InheritedSocketError("%s is not open" % where) from None
    if not stat.S_ISSOCK(mode):
        raise InheritedSocketError("%s is not a socket" % where)
    try:
        sock = HeldSocket(fileno=fd)
    except OSError as exc:
        raise InheritedSocketError("%s cannot be used: %s" % (where, exc.strerror or exc)) from None
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        sock.detach()
        raise InheritedSocketError(
            "%s is a %s socket, not TCP over IPv4 or IPv6" % (where, _name(sock.family)))
    if sock.type != socket.SOCK_STREAM:
        sock.detach()
        raise InheritedSocketError("%s is a %s socket, not a stream (TCP) one"
                                   % (where, _name(sock.type)))
    accepting = getattr(socket, "SO_ACCEPTCONN", None)
    if accepting is not None and not sock.getsockopt(socket.SOL_SOCKET, accepting):
        sock.detach()
        raise InheritedSocketError("%s is not listening (listen() was never called)" % where)
    os.set_inheritable(fd, False)  # as sd_listen_fds: not passed on to what the server runs
    return sock


def _name(constant):
    return getattr(constant, "name", str(constant))


def describe(sock):
    """'127.0.0.1:8080' or '[::1]:8080'."""
    host, port = sock.getsockname()[:2]
    return ("[%s]:%d" if ":" in host else "%s:%d") % (host, port)


# -- launchd -------------------------------------------------------------------
#
# <launch.h>, macOS 10.10 and later:
#   int launch_activate_socket(const char *name, int **fds, size_t *cnt);
# "Upon success, fds will point to an array of file descriptors allocated with
# malloc(3) [the caller frees it] and cnt the number of descriptors. Returns 0
# on success, or: ENOENT, the socket name does not exist in the caller's
# launchd.plist; ESRCH, the calling process is not managed by launchd;
# EALREADY, the socket has already been activated."

_LAUNCHD_ERRORS = {
    "ENOENT": "the job's plist has no Sockets entry of that name",
    "ESRCH": "this process was not started by launchd (or not as the job itself)",
    "EALREADY": "the socket was already taken by this process",
}


def launchd_sockets(name, library=None):
    """The fds of the job's Sockets entry `name` (launch_activate_socket)."""
    import ctypes
    import errno

    if library is None:
        if sys.platform != "darwin":
            raise InheritedSocketError(
                "MLX_HOTFIX_LAUNCHD_SOCKET=%s is set, but launchd sockets exist on macOS only"
                % name)
        library = ctypes.CDLL(None)  # libSystem holds launch_activate_socket and free
    activate = library.launch_activate_socket
    activate.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.POINTER(ctypes.c_int)),
                         ctypes.POINTER(ctypes.c_size_t)]
    activate.restype = ctypes.c_int
    fds = ctypes.POINTER(ctypes.c_int)()
    count = ctypes.c_size_t(0)
    code = activate(name.encode(), ctypes.byref(fds), ctypes.byref(count))
    if code != 0:
        symbol = errno.errorcode.get(code, str(code))
        why = _LAUNCHD_ERRORS.get(symbol, os.strerror(code))
        raise InheritedSocketError("launch_activate_socket(%r) failed: %s (%s)"
                                   % (name, symbol, why))
    try:
        return [fds[i] for i in range(count.value)]
    finally:
        free = library.free
        free.argtypes = [ctypes.c_void_p]
        free.restype = None
        free(ctypes.cast(fds, ctypes.c_void_p))
