"""socket: serve on a listening socket the server was given (systemd's
LISTEN_FDS, launchd's Sockets) instead of binding, so that the socket
outlives the server process.

Reason: no upstream issue; stock always binds its --host/--port itself, so
while a server restarts nothing listens and every new connection is refused
(for a large model, minutes). With a socket held by ``mlx-watchdog
supervise``, a systemd ``.socket`` unit or a launchd ``Sockets`` entry, those
connections wait in the kernel's backlog and the next process serves them.

How: ``ThreadingHTTPServer.server_bind`` (the stdlib class stock uses, on its
instances that serve mlx_lm's handler only) takes the inherited socket
(mlx_hotfix.inherited_socket) in place of the one it would bind, keeps its
owner's backlog, and says so on stderr. No socket given: stock's bind, as
before. A socket given but unusable (closed, not a socket, not TCP, not
listening), or LISTEN_FDS other than 1: one line naming the problem and
exit MLX_HOTFIX_EXIT_CODE (70), never a bind elsewhere. Only rank 0 of an
``mlx.launch`` group binds, and LISTEN_PID never names a rank (the launcher
starts them), so groups bind as before.

Gate: stock's listener class with server_bind; no upper version bound
(fail-safe: it acts only when a socket is passed). Off switch:
MLX_HOTFIX_DISABLE=socket (the server then binds itself, and fails to when
the socket's owner holds the port).

Test: tests/test_shim_socket.py (systemd-socket-activate, a real
socket-passing launcher, on 0.31.3 and 0.32.2; every kind of wrong fd; the
launchd call through ctypes against a C stand-in).
"""

import os
import socket

from .. import config, log
from .._wrap import _wrap, wrapped_by
from ..inherited_socket import InheritedSocketError, take
from ..inherited_socket import describe as describe_socket

NAME = "socket"
KIND = "fail-safe"
TARGET = "mlx_lm.server"
REASON = ("no upstream issue: stock always binds its own port, so connections are refused "
          "while it restarts (systemd LISTEN_FDS, launchd Sockets)")
VERSIONS = ("0.28.4", "0.33.0")
FIXED_IN = None
TEST = "tests/test_shim_socket.py"


def _wrap_server_bind(original):
    def server_bind(self, *args, **kwargs):
        from .heartbeat import serves_mlx_lm

        if not serves_mlx_lm(self):
            return original(self, *args, **kwargs)
        try:
            inherited = take(launchd_name=config.current().launchd_socket)
        except InheritedSocketError as exc:
            _refuse(exc)
        if inherited is None:
            return original(self, *args, **kwargs)
        sock, source = inherited
        wanted = self.server_address
        self.socket.close()  # the one TCPServer made for its own bind
        self.socket = sock
        # As HTTPServer.server_bind after its bind:
        self.server_address = sock.getsockname()
        host, port = self.server_address[:2]
        self.server_name = socket.getfqdn(host)
        self.server_port = port
        self._mlx_hotfix_held_socket = source  # the drain leaves its backlog to the next server
        note = ""
        if isinstance(wanted, tuple) and len(wanted) >= 2 and wanted[1] != port:
            note = " (not --port %s)" % wanted[1]
        log.say("serving on %s%s, the listening socket from %s" % (describe_socket(sock), note, source))
        return None

    return _wrap(original, server_bind, NAME)


def _refuse(exc):
    from .. import heartbeat

    code = config.current().exit_code
    log.say("%s; exiting %d (a wrong listening socket is never replaced by a bind of our own)"
            % (exc, code))  # said and flushed before the exit
    heartbeat.died(str(exc), True)  # the watchdog names the start-up failure by it
    os._exit(code)


def check_shape(server):
    listener = getattr(server, "ThreadingHTTPServer", None)
    if not isinstance(listener, type) or not callable(getattr(listener, "server_bind", None)):
        return "mlx_lm.server has no ThreadingHTTPServer with server_bind"
    return None


def apply(server):
    listener = server.ThreadingHTTPServer
    if not wrapped_by(listener.server_bind, NAME):  # the stdlib's class, shared
        listener.server_bind = _wrap_server_bind(listener.server_bind)
