"""disconnect: a non-streaming client that hangs up stops its generation.

Reason: ml-explore/mlx-lm#677 (still so in 0.32.2). A streaming handler
notices a closed connection when a write fails; its ``finally: ctx.stop()``
then makes the generation loop drop the request. A non-streaming handler
writes nothing until the end, so a client that gave up is never noticed: its
generation runs on to max_tokens and holds a decode slot the whole time
(with --decode-concurrency 1, everyone behind it waits).

How: while a non-streaming completion waits, its socket is registered with
one watcher thread (a selector over every waiting socket, blocking, no
polling). Readable with a 1-byte MSG_PEEK recv returning b'' means the peer
closed; nothing is consumed, so the request body is never read twice. Then
the request is stopped as stock stops a streaming one: ``ctx.stop()`` (the
loop removes it from the batch at its next step), and the handler thread,
which waits on the request's response queue (in a batch stock never puts an
end on it once stopped), is woken and closes the connection without writing.
A client that half-closes its sending side after the request (rare for HTTP
clients) reads as gone too.

Each cancelled request is one stderr line, a count (``cancelled_count()``,
crash reports) and a call to ``heartbeat.cancelled()`` where the heartbeat
has it.

The watcher outlives anything one request does: an exception (a raising
``ctx.stop()``, say) is said once on stderr and it watches on; a select()
that keeps failing is retried after a pause growing to 1 s, never in a spin.

Test: tests/test_patch_disconnect.py (a 4000-token request whose client
leaves after 0.5 s is stopped on both releases; a client that stays gets its
whole answer; a streaming client is unaffected).
"""

import socket
import threading
import time

from .. import heartbeat, log
from .._wrap import _MARK
from .._wrap import _wrap as _wrap_as
from . import loop_shapes
from ._source import source_of

NAME = "disconnect"
TARGET = "mlx_lm.server"
REASON = "ml-explore/mlx-lm#677: a non-streaming client that hangs up keeps its generation running"
VERSIONS = ("0.31.0", "0.33.0")
FIXED_IN = None
TEST = "tests/test_patch_disconnect.py"
KIND = "fix"


class ClientGone(BaseException):
    """Raised in a handler thread whose client has closed the connection."""


_HUNG_UP = object()  # put on a response queue to wake its reader
_local = threading.local()
_count_lock = threading.Lock()
_cancelled = 0


def cancelled_count():
    return _cancelled


class _Waiting:
    """One non-streaming request whose client is being watched."""

    def __init__(self, handler):
        self.handler = handler
        self.sock = handler.connection
        self.lock = threading.Lock()
        self.ctx = None
        self.queue = None
        self.tokens = 0
        self.gone = False
        self.finished = False  # the generation ended; the handler is answering

    def attach(self, ctx):
        """The request's context arrived (handler thread)."""
        with self.lock:
            self.ctx = ctx
            gone = self.gone
        if gone:
            self._cancel(ctx)

    def hung_up(self):
        """The peer closed (watcher thread)."""
        with self.lock:
            if self.gone or self.finished:
                return  # a client that read its whole answer and closed did not hang up
            self.gone = True
            ctx = self.ctx
        if ctx is not None:  # else attach() cancels when the context arrives
            self._cancel(ctx)

    def _cancel(self, ctx):
        global _cancelled
        try:
            ctx.stop()
        finally:  # whatever stop() does, the handler waiting for the answer wakes
            if self.queue is not None:
                self.queue.put(_HUNG_UP)
        with _count_lock:
            _cancelled += 1
            total = _cancelled
        count = getattr(heartbeat, "cancelled", None)
        if count is not None:
            try:
                count()
            except Exception:  # noqa: BLE001
                pass
        log.say("client hung up: stopped its generation after %d tokens (%d cancelled so far)"
                % (self.tokens, total))


def _peer_closed(sock):
    """True if the peer closed, False if it sent data, None if nothing to read."""
    try:
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError, socket.timeout):
        return None
    except OSError:
        return True  # reset, or the socket is gone
    return data == b""


class _Watcher:
    """One thread blocking in a selector over every waiting client's socket."""

    def __init__(self):
        import selectors

        self._lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        # Keeps one registration alive (kqueue with none would not block).
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._events = selectors.EVENT_READ
        self._said = False
        self._thread = threading.Thread(target=self._run, name="mlx-hotfix-disconnect",
                                        daemon=True)
        self._thread.start()

    def add(self, waiting):
        with self._lock:
            try:
                self._selector.register(waiting.sock, self._events, waiting)
            except (ValueError, KeyError, OSError):
                return False
        return True

    def remove(self, waiting):
        with self._lock:
            try:
                self._selector.unregister(waiting.sock)
            except (ValueError, KeyError, OSError):
                pass

    def _run(self):
        # The watcher must outlive anything one request does: a failure is
        # said once and the loop goes on; a select() that keeps failing is
        # retried after a growing pause (up to _PAUSE_MAX_S), never in a spin.
        pause = 0.0
        while True:
            try:
                events = self._selector.select()
                pause = 0.0
            except OSError as error:
                pause = min(max(pause * 2, _PAUSE_MIN_S), _PAUSE_MAX_S)
                self._failed("select", error)
                _pause(pause)
                continue
            for key, _ in events:
                try:
                    self._look_at(key)
                except Exception as error:  # noqa: BLE001
                    self._failed("a hung-up client", error)

    def _look_at(self, key):
        waiting = key.data
        if waiting is None:
            return
        closed = _peer_closed(key.fileobj)
        if closed is None:
            return
        self.remove(waiting)  # either way: a readable socket would wake us again
        if closed:
            waiting.hung_up()

    def _failed(self, what, error):
        if self._said:
            return
        self._said = True
        log.say("the disconnect watcher failed on %s (%s: %s); it goes on (said once)"
                % (what, error.__class__.__name__, error))


_PAUSE_MIN_S = 0.05
_PAUSE_MAX_S = 1.0
_pause = time.sleep  # (a test counts the pauses)

_watcher = None
_watcher_lock = threading.Lock()


def _get_watcher():
    global _watcher
    with _watcher_lock:
        if _watcher is None:
            _watcher = _Watcher()
        return _watcher


# -- the wrappers ----------------------------------------------------------------


def _make_hangup_queue(base):
    base_get = base.get  # bound here: get runs once per token

    class _HangupQueue(base):
        """A response queue that a hung-up client's watcher can wake."""

        _mlx_hotfix_waiting = None

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            waiting = getattr(_local, "waiting", None)
            self._mlx_hotfix_waiting = None
            if waiting is not None and waiting.queue is None:
                waiting.queue = self
                self._mlx_hotfix_waiting = waiting

        def get(self, block=True, timeout=None):
            item = base_get(self, block, timeout)
            if item is _HUNG_UP:
                super().put(item)  # any later reader refuses too
                raise ClientGone()
            waiting = self._mlx_hotfix_waiting
            if waiting is not None:
                if hasattr(item, "token"):
                    waiting.tokens += 1
                if item is None or getattr(item, "finish_reason", None) is not None:
                    waiting.finished = True  # its answer is on the way: a close is no hang-up
            return item

    _HangupQueue.__name__ = base.__name__
    _HangupQueue.__qualname__ = base.__qualname__
    setattr(_HangupQueue, _MARK, NAME)
    return _HangupQueue


def _wrap_handle_completion(original):
    def handle_completion(self, *args, **kwargs):
        if getattr(self, "stream", False) or getattr(self, "connection", None) is None:
            return original(self, *args, **kwargs)  # a stream notices on its own
        waiting = _Waiting(self)
        watcher = _get_watcher()
        if not watcher.add(waiting):
            return original(self, *args, **kwargs)
        _local.waiting = waiting
        try:
            return original(self, *args, **kwargs)
        except ClientGone:
            self.close_connection = True  # nobody to answer
        finally:
            _local.waiting = None
            watcher.remove(waiting)

    return _wrap(original, handle_completion)


def _wrap_generate(original):
    def generate(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        waiting = getattr(_local, "waiting", None)
        if waiting is not None:
            waiting.attach(result[0])
        return result

    return _wrap(original, generate)


def _wrap(function, wrapper):
    return _wrap_as(function, wrapper, NAME)


# -- gate and apply ----------------------------------------------------------------


def check_shape(server):
    import queue

    why = loop_shapes.check_stoppable(server, ("handle_completion", "do_POST"), ("generate",))
    if why is not None:
        return why
    handler = server.APIHandler
    if getattr(server.Queue, "_mlx_hotfix_hangup", False):
        return "already applied"
    if not (isinstance(server.Queue, type) and issubclass(server.Queue, queue.Queue)):
        return "mlx_lm.server does not use queue.Queue for responses"
    completion = source_of(handler.handle_completion)
    post = source_of(handler.do_POST)
    if completion is None or post is None:
        return "cannot read the source of APIHandler"
    # The bug: only the streaming path writes (and so notices) before the end;
    # the stop is the context's, as the streaming path uses it.
    if "ctx.stop()" not in completion or "if self.stream" not in completion:
        return "handle_completion no longer stops the context as this expects"
    if "self.stream" not in post:
        return "do_POST does not set self.stream"
    return None


def apply(server):
    generator = server.ResponseGenerator
    handler = server.APIHandler
    hangup_queue = _make_hangup_queue(server.Queue)
    hangup_queue._mlx_hotfix_hangup = True
    replacements = [
        (server, "Queue", hangup_queue),
        (generator, "generate", _wrap_generate(generator.generate)),
        (handler, "handle_completion", _wrap_handle_completion(handler.handle_completion)),
    ]
    for owner, name, value in replacements:
        setattr(owner, name, value)
