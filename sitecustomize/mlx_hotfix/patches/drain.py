"""drain: the first SIGTERM lets the requests the server has accepted finish,
takes no new ones, then stops as before.

Reason: no upstream issue; stock dies of SIGTERM at once, so every restart
(a planned one, a supervisor's, ``systemctl restart``, ``launchctl kickstart
-k``) cuts every request in flight, although most would finish in seconds.
vLLM (``--shutdown-timeout``) and SGLang drain; mlx_lm.server does not.

How, from the first SIGTERM (the ``exit`` part's signal handler hands it here):
- Nothing new is taken. A server that bound its own port keeps accepting and
  answers each new completion ``503`` with ``Retry-After`` ("the server is
  restarting") and ``/health`` ``503 {"status": "draining"}``, so a load
  balancer moves away at once. A server on an inherited listening socket
  (patches/held_socket.py: supervise, systemd's .socket, launchd's Sockets)
  stops accepting instead: new connections wait in the kernel's backlog and
  the next server process answers them, so nobody is refused or failed. (On
  a held socket the same goes once the generation thread died: only the
  requests in flight at the death are answered 503.)
- Requests already accepted (generating, or waiting for a slot) go on to
  their normal end, streams to ``[DONE]``.
- On a port of its own, the server goes on answering 503 once nothing is
  left, until no new request came for MLX_HOTFIX_DRAIN_QUIET (3 s, counted
  from the SIGTERM at the earliest): a load balancer's check sees /health
  503 "draining" and takes the server out before the port closes. Closing it
  at once would reset the connections the balancer sent meanwhile, in the
  kernel's backlog (HAProxy answers its client 502). No wait on a held socket.
- The drain ends when nothing is left (and the port is quiet), at
  MLX_HOTFIX_DRAIN_TIMEOUT (25 s), or at once when it cannot progress: the
  generation loop stalled (the heartbeat says so), or nothing delivered for
  NO_PROGRESS_S while requests wait, or the generation thread gone. Then the exit part's stop answers what
  is left (503 JSON, or a final SSE error event) and the process dies of the
  signal, as before.
- A second SIGTERM, a SIGINT, MLX_HOTFIX_DRAIN_TIMEOUT=0, or a process that
  is a rank of an ``mlx.launch`` group: the exit part's immediate answer, as
  before. (The ranks of a group cannot drain one without the others: rank 1
  stops at once, and rank 0's loop then waits in a collective.)
- One stderr line when the drain starts and one when it ends (how many
  requests finished, how many were cut, and why it ended).

Gate: the exit part applied (its stop does the answering) and the server's
HTTP listener class; no upper version bound (fail-safe: it changes no
result, only when the process goes). Off switch: MLX_HOTFIX_DISABLE=drain.

Test: tests/test_shim_drain.py (8 requests through a drain on 0.31.3 and
0.32.2, the port kept open while requests keep coming, a drain timeout
shorter than the work, a hung loop, SIGINT); tests/test_haproxy_rolling.py.
"""

import threading
import time

from .. import config, heartbeat, log
from .._wrap import _wrap, wrapped_by
from ..group import rank as group_rank
from . import exit as exit_part
from . import stop_signals
from ._http import send_json
from .heartbeat import _is_probe

NAME = "drain"
KIND = "fail-safe"
TARGET = "mlx_lm.server"
REASON = ("no upstream issue: stock dies of SIGTERM at once and cuts every request in flight "
          "(vLLM and SGLang drain)")
VERSIONS = ("0.28.4", "0.33.0")
FIXED_IN = None
TEST = "tests/test_shim_drain.py"

# Requests wait and nothing was delivered for this long (at most the stall
# timeout): the loop cannot finish them, and the drain stops waiting.
NO_PROGRESS_S = 5.0
# A connection accepted this long ago that has not begun a completion is
# idle (a client that opened and sent nothing): it does not hold the drain.
IDLE_CONNECTION_S = 1.0
_POLL_S = 0.1

REFUSAL = ("the server is restarting: it finishes the requests it has and takes no new "
           "ones; retry in a moment")


class Listener:
    """One of the server's HTTP listeners: its connections, and whether it
    still accepts. Wired onto the server instance (see _watch_listener)."""

    def __init__(self, held):
        self.held = held  # an inherited socket: the next server takes the backlog
        self.accepting = True
        self.open = {}  # accepted connection -> monotonic time of the accept


class Drain:
    """The process-wide drain: accepted requests, and the drain itself."""

    def __init__(self):
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.listeners = []
        self.active = 0  # completions being handled
        self.started_at = None  # monotonic time of the SIGTERM that began the drain
        self.signum = None
        self.refusing = False  # new completions get 503 (a listener of our own)
        self.finished = 0  # accepted completions that ended during the drain
        self.refused = 0
        self.last_refused_at = None  # monotonic time of the newest refusal

    @property
    def draining(self):
        return self.started_at is not None

    # -- request threads -------------------------------------------------------
    def admit(self, probe=False):
        """A completion begins: True to serve it, False to refuse it (draining).
        A watchdog's probe is refused too, but is no client a balancer sends:
        it does not keep the port open."""
        with self._lock:
            if self.refusing:
                self.refused += 1
                if not probe:
                    self.last_refused_at = time.monotonic()
                return False
            self.active += 1
            return True

    def done(self):
        with self._lock:
            self.active -= 1
            if self.started_at is not None:
                self.finished += 1
            self._changed.notify_all()

    def accepted(self, listener, request):
        with self._lock:
            listener.open[request] = time.monotonic()

    def closed(self, listener, request):
        with self._lock:
            listener.open.pop(request, None)
            self._changed.notify_all()

    # -- the signal: from the exit part's handler (stop_signals.py), so no locks here
    def begin(self, signum):
        """Start draining on this SIGTERM; False when the caller should stop
        at once instead (a second SIGTERM, a drain timeout of 0, a group)."""
        if self.started_at is not None or exit_part.lifeline.dead:
            return False
        if config.current().drain_timeout <= 0 or _in_a_group():
            return False
        self.signum = signum
        held = any(listener.held for listener in self.listeners)
        if held:
            for listener in self.listeners:
                listener.accepting = False  # the backlog waits for the next server
        else:
            self.refusing = True
        self.started_at = time.monotonic()
        threading.Thread(target=self._run, name="mlx-hotfix-drain", daemon=True).start()
        return True

    # -- the drain thread --------------------------------------------------------
    def _run(self):
        settings = config.current()
        deadline = self.started_at + settings.drain_timeout
        held = any(listener.held for listener in self.listeners)
        with self._lock:
            waiting, connections = self.active, self._open_connections()
        log.say(
            "signal %d: draining: %d request(s) to finish, no new ones (%s); at most %gs, a "
            "second SIGTERM or a SIGINT stops at once"
            % (self.signum, waiting, "they wait for the next server" if held else
               "503, until no new one came for %gs" % settings.drain_quiet,
               settings.drain_timeout) + ("" if connections <= waiting else
                                          " (%d connection(s) open)" % connections))
        heartbeat.notify_status("draining: %d request(s) to finish" % waiting)
        why = None
        while True:
            if exit_part.lifeline.dead:
                return  # a death or a second signal answers everyone now
            now = time.monotonic()
            if self._nothing_left(now, held):
                if held or self._quiet(now, settings) or now >= deadline:
                    break  # (a port still busy at the deadline cuts nobody: stop)
            elif now >= deadline:
                why = "the drain timeout (%gs) ran out" % settings.drain_timeout
                break
            else:
                why = _no_progress(now, settings)
                if why:
                    break
            with self._lock:
                self._changed.wait(min(_POLL_S, max(0.0, deadline - now)))
        with self._lock:
            finished, cut, refused = self.finished, self.active, self.refused
        log.say(
            "drain over after %.1fs: %d request(s) finished, %d cut%s%s; stopping"
            % (time.monotonic() - self.started_at, finished, cut,
               " (%s)" % why if why else "",
               ", %d new one(s) refused" % refused if refused else ""))
        for listener in self.listeners:
            listener.accepting = False
        exit_part.lifeline.stop_serving(self.signum)

    def _quiet(self, now, settings):
        """On a port of our own: no new request for the quiet time, so a
        balancer has taken this server out (or there is none)."""
        with self._lock:
            last = max(self.started_at, self.last_refused_at or self.started_at)
        return now - last >= settings.drain_quiet

    def _open_connections(self):
        return sum(len(listener.open) for listener in self.listeners)

    def _nothing_left(self, now, held):
        with self._lock:
            if self.active:
                return False
            if not held:
                return True  # new connections are refused; their answers are quick
            # Nothing new is accepted: wait for the connections we have, but
            # not for one that has sent nothing since its accept.
            return all(now - since > IDLE_CONNECTION_S
                       for listener in self.listeners for since in listener.open.values())

    def health(self):
        now = time.monotonic()
        body = {"status": "draining", "in_flight": self.active,
                "draining_for_s": round(now - self.started_at, 3),
                "drain_timeout_s": config.current().drain_timeout}
        # memory and admission's queued/running, as in every other /health body
        body.update(heartbeat.health_fields())
        return body


state = Drain()


def draining():
    """True from the SIGTERM that began a drain until the process ends."""
    return state.draining


def _in_a_group():
    return group_rank() is not None


def _no_progress(now, settings):
    """Why the drain cannot finish what is left, or None."""
    if heartbeat.phase() == heartbeat.STALLED:
        return "the generation loop is stalled"
    if heartbeat.loop_running() and not exit_part.generation_thread_alive():
        return "the generation thread is gone"
    waited = heartbeat.undelivered_for(now)
    limit = min(NO_PROGRESS_S, settings.stall_timeout)
    if waited > limit:
        return "nothing delivered for %.0fs while requests wait" % waited
    return None


# -- the wrappers ------------------------------------------------------------


def refuse(handler):
    """A new completion during the drain: 503, Retry-After, the reason."""
    body = {"error": {"message": REFUSAL, "type": "server_error", "code": 503}}
    try:
        send_json(handler, 503, body, close=True)
    except (OSError, ValueError):
        pass  # the client left
    handler.close_connection = True


def _wrap_handle_completion(original):
    def handle_completion(self, *args, **kwargs):
        if not state.admit(probe=_is_probe(self)):
            return refuse(self)
        try:
            return original(self, *args, **kwargs)
        finally:
            state.done()

    return _wrap(original, handle_completion, NAME)


def _wrap_health(original):
    def handle_health_check(self, *args, **kwargs):
        if state.draining and not exit_part.lifeline.dead:
            return send_json(self, 503, state.health())
        return original(self, *args, **kwargs)

    return _wrap(original, handle_health_check, NAME)


def _wrap_server_activate(original):
    def server_activate(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        from .heartbeat import serves_mlx_lm

        if serves_mlx_lm(self):
            _watch_listener(self)
        return result

    return _wrap(original, server_activate, NAME)


_PARK_S = 0.05


def _wait_to_accept(listener):
    """While this process takes no new connections, the accept loop's thread
    waits here and the listening socket's backlog is left alone: for the next
    server on a held socket. That is from the drain on, and on a held socket
    also once the generation thread died or a stop began (until the recover
    part revives the loop, if it does)."""
    lifeline = exit_part.lifeline
    while not listener.accepting or (listener.held and lifeline.dead):
        time.sleep(_PARK_S)


def _watch_listener(httpd):
    """Count httpd's connections and let the drain stop its accepts (methods
    set on this one instance; the class is left alone)."""
    listener = Listener(held=bool(getattr(httpd, "_mlx_hotfix_held_socket", None)))
    get_request, shutdown_request = httpd.get_request, httpd.shutdown_request

    def accept():
        _wait_to_accept(listener)
        request = get_request()
        state.accepted(listener, request[0])
        return request

    def shutdown(request):
        try:
            shutdown_request(request)
        finally:
            state.closed(listener, request)

    httpd.get_request = accept
    httpd.shutdown_request = shutdown
    state.listeners.append(listener)


# -- gate and apply ----------------------------------------------------------


def check_shape(server):
    from . import status

    if not status.get(exit_part.NAME, "").startswith("applied"):
        return "needs the exit part (it answers what is left when the drain ends)"
    handler = getattr(server, "APIHandler", None)
    for method in ("handle_completion", "handle_health_check"):
        if not callable(getattr(handler, method, None)):
            return "mlx_lm.server.APIHandler has no %s" % method
    listener = getattr(server, "ThreadingHTTPServer", None)
    if not isinstance(listener, type) or not all(
            callable(getattr(listener, name, None))
            for name in ("server_activate", "get_request", "shutdown_request")):
        return "mlx_lm.server has no ThreadingHTTPServer to drain"
    return None


def apply(server):
    handler = server.APIHandler
    listener = server.ThreadingHTTPServer
    replacements = [
        (handler, "handle_completion", _wrap_handle_completion(handler.handle_completion)),
        (handler, "handle_health_check", _wrap_health(handler.handle_health_check)),
    ]
    if not wrapped_by(listener.server_activate, NAME):  # the stdlib's class, shared
        replacements.append(
            (listener, "server_activate", _wrap_server_activate(listener.server_activate)))
    for owner, name, value in replacements:
        setattr(owner, name, value)
    stop_signals.stop_hook = state.begin


def describe():
    timeout = config.current().drain_timeout
    if timeout <= 0:
        return "off: MLX_HOTFIX_DRAIN_TIMEOUT=0, a SIGTERM answers at once"
    return "at most %gs" % timeout
