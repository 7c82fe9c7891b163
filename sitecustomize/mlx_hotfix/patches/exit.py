"""exit: when the server's generation thread dies, answer every waiting client
and exit, so that launchd, systemd or any supervisor restarts the server.

Reason: ml-explore/mlx-lm#1505. Stock 0.31.x lets the exception reach
threading.excepthook and keeps serving: /health says 200 while every
completion waits forever on a queue nobody feeds. Stock 0.32.x catches it in
``_run_generate``, turns /health to 503 and fails requests, but the process
lives on, so KeepAlive and Restart= never fire. Users measured 5 to 52 hours
per event.

How: the thread's target is the bound method ``ResponseGenerator._generate``
(0.28.4 to 0.31) or ``_run_generate``, which calls ``_generate`` (0.32). Wrapping
``_generate`` on the class catches the death in both, before stock code sees
it, and only for that thread: a user's own function named ``_generate``, or
any other thread, is never touched. The exception is re-raised unchanged, so
stock logging (or the previous excepthook) prints the traceback once.

Every queue the server module creates is a ``_WatchedQueue``; at death each
gets a sentinel, and a client blocked on it wakes with GenerationThreadDied
(a BaseException, so stock ``except Exception`` handlers cannot turn it into
a 404). The wrapped ``handle_completion`` answers: 503 with a JSON error, or,
when stream headers are already out, a final SSE error event; then the
connection closes. A reaper thread exits with MLX_HOTFIX_EXIT_CODE once every
client is answered, or when MLX_HOTFIX_EXIT_GRACE runs out.

Every death is classified (mlx_hotfix/signatures.py) before any client is
told: the class is in the death line (``generation thread died: <class>:
<Type>: <message>; exiting 70``), the answers' ``"cause"`` (never the
message's text), the crash report (cause, remedy, source) and the heartbeat's
``death.cause``, where the watchdog reads it.

Every threaded release 0.28.4 to 0.32.x has the zombie. Two loop shapes
(patches/loop_shapes.py): 0.30.6+ turns through ``_next_request``, 0.28.4 to
0.30.5 through its request queue; each has its own shape check, and the
heartbeat hooks come from ``loop_shapes.loop_hooks``. Before 0.28.4 there is
no generation thread: "exit skipped: no generation thread in this release".

SIGTERM and SIGINT answer every waiting client first too (stop_signals.py,
installed by apply).

Test: tests/test_shim_exit.py (excepthook death on 0.31.3, caught-by-stock
death on 0.32.2, death at model load, negative controls);
tests/test_matrix.py (one death per release line, 0.28.4 to 0.32.2, and a
stock tree relabelled 0.33.0).
"""

import json
import os
import sys
import threading
import time
import weakref

from .. import config, heartbeat, log, reports
from .._wrap import _MARK
from .._wrap import _wrap as _wrap_as
from . import loop_shapes, stop_signals
from ._http import send_json

NAME = "exit"
TARGET = "mlx_lm.server"
REASON = "ml-explore/mlx-lm#1505: a dead generation thread leaves a zombie server"
VERSIONS = ("0.28.4", "0.33.0")  # the generation thread arrived in 0.28.4
FIXED_IN = None
TEST = "tests/test_shim_exit.py"
KIND = "fail-safe"


class GenerationThreadDied(BaseException):
    """Raised in a request thread whose answer will never come."""


_SENTINEL = object()
_SETTLE_S = 0.05


class Lifeline:
    """The process-wide record of the generation thread's death and the exit."""

    def __init__(self):
        self._lock = threading.Lock()
        self._queues = weakref.WeakSet()
        self._handlers = set()
        self._entered = 0  # connections ever entered: a late arrival resets the quiet wait
        self._idle = threading.Condition(self._lock)
        self.dead = False
        self.cause = None
        self.death_class = None  # the cause's class (signatures.Match), or None
        self.died_at = None
        self.in_flight = None
        self.stopping = None  # the signal that asked the server to stop, if one did
        # The recover part's policy, when MLX_HOTFIX_RECOVER=thread (else None):
        # plan(exc, during_startup) -> None to exit, or what it will do instead;
        # recover(generator, exc) -> True once a fresh loop serves (patches/recover.py).
        self.recovery = None

    # -- bookkeeping, called from request threads --------------------------
    def watch_queue(self, q):
        with self._lock:
            self._queues.add(q)
            dead = self.dead
        if dead:
            q.put(_SENTINEL)

    def enter(self, handler):
        with self._lock:
            self._handlers.add(handler)
            self._entered += 1

    def leave(self, handler):
        with self._lock:
            self._handlers.discard(handler)
            if not self._handlers:
                self._idle.notify_all()

    # -- the death ------------------------------------------------------------
    #
    # The one path that must never fail: whatever raises on it (a thread that
    # cannot start, a recovery plan, a report), the process ends in os._exit
    # unless a recovery succeeded. No reaper thread: the dying thread exits.

    def die(self, generator, exc, during_startup):
        try:
            # Before any client is told: they get its class. A known-bad pair
            # dies on the first request, never while the model loads.
            match = classify_death(exc, bad_pair=not during_startup)
            with self._lock:
                if self.dead:
                    return
                self.dead = True
                self.cause = exc
                self.death_class = match
                self.died_at = time.monotonic()
                queues = list(self._queues)
                self.in_flight = reports.capture_in_flight(self._handlers)  # before the answers
            heartbeat.stop()  # before the wake-ups below, which are not progress
            for q in queues:  # wake every waiting client
                try:
                    q.put(_SENTINEL)
                except Exception:  # noqa: BLE001
                    pass
            reaper = threading.Thread(
                target=self._reap,
                args=(generator, exc, during_startup),
                name="mlx-hotfix-exit",
                daemon=True,
            )
            try:
                reaper.start()
            except BaseException as error:  # noqa: BLE001 - "can't start new thread"
                _say_safely("cannot start the exit thread (%s: %s); exiting from the dying "
                            "thread" % (error.__class__.__name__, error))
                _print_traceback(exc)  # stock would print it after we return; we never do
                self._reap(generator, exc, during_startup, can_recover=False)
        except BaseException as error:  # noqa: BLE001 - the last resort
            _exit_now("the exit path failed (%s: %s)" % (error.__class__.__name__, error))

    def _reap(self, generator, exc, during_startup, can_recover=True):
        recovered, why = False, None
        try:
            recovered = self._answer_then_exit(generator, exc, during_startup, can_recover)
        except BaseException as error:  # noqa: BLE001
            why = "the exit path failed (%s: %s)" % (error.__class__.__name__, error)
            try:  # the woken clients are being answered on their own threads
                self._wait_for_answers(self.died_at + config.current().exit_grace)
            except BaseException:  # noqa: BLE001
                pass
        finally:
            if not recovered:
                _exit_now(why)

    def _answer_then_exit(self, generator, exc, during_startup, can_recover):
        """Answer every client, write the report, then exit (or recover: True)."""
        settings = config.current()
        deadline = self.died_at + settings.exit_grace
        # Let the stock handler (excepthook or logging) print the traceback.
        thread = getattr(generator, "_generation_thread", None)
        recovery = self.recovery if can_recover else None
        if thread is not None and thread is not threading.current_thread():
            timeout = max(0.0, deadline - time.monotonic())
            if recovery is not None:  # its loop thread parks after a death, it does not end
                recovery.wait_loop_ended(thread, timeout)
            else:
                thread.join(timeout)
        where = "; during start-up (model load)" if during_startup else ""
        plan = recovery.plan(exc, during_startup) if recovery is not None else None
        match = self.death_class
        cls = cause_name(match)
        log.say(
            "generation thread died: %s: %s: %s%s; %s"
            % (cls, exc.__class__.__name__, _one_line(exc), where,
               plan or "exiting %d" % settings.exit_code)
        )
        pairing = _note_known_bad_pair()
        if plan is None:
            heartbeat.died("%s: %s" % (exc.__class__.__name__, _one_line(exc)), during_startup,
                           cause=cls)
        if plan is None:  # a recovery writes its own "recovered" report
            extra = {"in_flight": len(self.in_flight or ()), "in_flight_requests": self.in_flight,
                     "exit_code": settings.exit_code, "during_startup": during_startup}
            extra.update(cause_fields(match))
            refused = getattr(recovery, "refused", None)
            if refused:  # MLX_HOTFIX_RECOVER=thread, and this death was not recovered: why
                extra["recovery_refused"] = refused
            if pairing:
                extra["pairing_warning"] = pairing
            reports.write_report("died", exc=exc, extra=extra)  # within the grace; never raises
        # A recovery does not wait for the answers: each waiting client is
        # answered on its own thread from its sentinel, and the process stays.
        # (Waiting would cost the whole grace whenever a client keeps an idle
        # connection open.) Only an exit must not cut a client off.
        if plan is not None:
            if recovery.recover(generator, exc):
                return True
            deadline = time.monotonic() + settings.exit_grace  # it failed: answer, then exit
        unanswered = self._wait_for_answers(deadline)
        if unanswered:
            log.say("%d client(s) not answered within the grace" % unanswered)
        heartbeat.notify_stopping("generation thread died; exiting")
        _flush_output()
        os._exit(settings.exit_code)

    def _wait_for_answers(self, deadline):
        """Until every connection is answered, or deadline; the unanswered count."""
        with self._lock:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if self._handlers:
                    self._idle.wait(left)
                    continue
                # Quiet for a moment: a connection the server just accepted
                # has not reached its handler yet.
                entered = self._entered
                self._idle.wait(min(_SETTLE_S, left))
                if not self._handlers and self._entered == entered:
                    break
            return len(self._handlers)

    # -- a stop asked for: answer, then go as asked ----------------------------
    def stop_serving(self, signum):
        """SIGTERM: every waiting client gets the same 503 (or SSE error event)
        as at a death instead of a reset connection, then the process dies of
        the signal as it would have (within MLX_HOTFIX_EXIT_GRACE). A supervisor
        restarting the server, or mlx.launch stopping the other ranks of a
        group, so never leaves a client without an answer."""
        with self._lock:
            if self.dead:
                return  # a death is being answered already; its exit follows
            self.dead = True
            self.stopping = signum
            self.died_at = time.monotonic()
            queues = list(self._queues)
        heartbeat.stop()
        for q in queues:
            try:
                q.put(_SENTINEL)
            except Exception:  # noqa: BLE001 - a queue that cannot take it is not waited on
                pass
        unanswered = self._wait_for_answers(self.died_at + config.current().exit_grace)
        if unanswered:
            log.say("%d client(s) not answered within the grace" % unanswered)
        heartbeat.notify_stopping("stopping (signal %d)" % signum)
        _flush_output()
        os.kill(os.getpid(), signum)  # its default action again (on_sigterm reset it)

    def revive(self):
        """A fresh generation loop serves again (the recover part): accept requests.
        The cause stays: a client of the dead loop may still be answering."""
        with self._lock:
            self._queues = weakref.WeakSet()  # the dead loop's, each holding a sentinel
            self.died_at = None
            self.dead = False


lifeline = Lifeline()


# -- the death's class (signatures.py, the table shared with the watchdog) -----

# What of a match's detail a report keeps: names of ranks, hosts, devices and
# numbers, never text that could quote a request (the message is redacted).
_SAFE_DETAIL = ("rank", "host", "failed_rank", "failed_exit_code", "errno", "fd", "limit",
                "bytes", "max_bytes", "device", "backend", "missing", "extra", "model_type")


def classify_death(exc, bad_pair=False):
    """The class of a death (a signatures.Match), or None. Never raises. With
    bad_pair, a death the table does not know, on a known-bad mlx-lm/mlx
    pair, is that pair's (config-bad-pair): it fails the same way after
    every restart."""
    try:
        import traceback

        from .. import signatures

        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        match = signatures.classify(exc.__class__.__name__, str(exc), text)
        if bad_pair and not match.known and _known_bad_pair():
            match = signatures.Match(signatures.entry("config-bad-pair"))
        return match
    except BaseException:  # noqa: BLE001 - classifying must never make a death worse
        return None


def cause_name(match):
    return match.cls if match is not None else "unknown"


def cause_fields(match):
    """A report's fields for a death's class: cause, remedy, where it comes from."""
    if match is None:
        return {"cause": "unknown"}
    entry = match.entry
    detail = {k: v for k, v in match.detail.items()
              if k in _SAFE_DETAIL and isinstance(v, (int, str)) and len(str(v)) <= 200}
    return {"cause": match.cls, "cause_title": entry.title, "remedy": entry.remedy,
            "cause_source": entry.source, "restart_helps": entry.restart_helps,
            "cause_detail": detail}


def _known_bad_pair():
    """This mlx-lm runs with a package release it is known to die with (a
    yanked release alone is not a pair)."""
    try:
        from .. import pairings
        from ..versions import mlx_lm_version, mlx_version

        found = pairings.problems(mlx_lm_version(), mlx_version(),
                                  pairings.installed_version("transformers"))
        return any("was yanked" not in problem for problem in found)
    except Exception:  # noqa: BLE001
        return False


def _note_known_bad_pair():
    """A death from a known-bad mlx-lm/mlx pair: say why; the warning, for the report."""
    try:
        from ..versions import pairing_warning

        warning = pairing_warning()
    except Exception:  # noqa: BLE001
        return None
    if warning:
        log.say("this death is likely the known-bad pair: " + warning)
    return warning or None


def _say_safely(message):
    try:
        log.say(message)
    except BaseException:  # noqa: BLE001 - saying so must not stop the exit
        pass


def _print_traceback(exc):
    try:
        import traceback

        traceback.print_exception(type(exc), exc, exc.__traceback__)
    except BaseException:  # noqa: BLE001
        pass


def _exit_now(why):
    """os._exit with MLX_HOTFIX_EXIT_CODE (70 if even that cannot be read)."""
    try:
        code = config.current().exit_code
    except BaseException:  # noqa: BLE001
        code = 70
    if why:
        _say_safely("%s; exiting %d" % (why, code))
    _flush_output()
    os._exit(code)


def _flush_output():
    """Flush stdout and stderr before the process ends without Python's own exit."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream must not stop the exit
            pass


def _one_line(exc):
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else "(no message)"


def error_message():
    """What every waiting client and /health are told: the exception's type and
    a fixed sentence, never its text (it may quote another client's request;
    the text goes to stderr and, redacted, to the crash report)."""
    if lifeline.stopping is not None:
        return "the server is stopping (signal %d) and will be restarted" % lifeline.stopping
    cause = lifeline.cause
    what = cause.__class__.__name__ if cause is not None else "unknown"
    return "generation thread died (%s); the server is restarting" % what


# -- the wrappers ------------------------------------------------------------


def _make_watched_queue(base):
    base_get = base.get  # bound here: get runs once per token

    class _WatchedQueue(base):
        """A Queue that wakes its reader with GenerationThreadDied at death."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            lifeline.watch_queue(self)

        def get(self, block=True, timeout=None):
            item = base_get(self, block, timeout)
            if item is _SENTINEL:
                super().put(item)  # any later reader refuses too
                raise GenerationThreadDied(error_message())
            return item

    _WatchedQueue.__name__ = base.__name__
    _WatchedQueue.__qualname__ = base.__qualname__
    setattr(_WatchedQueue, _MARK, NAME)
    return _WatchedQueue


def _wrap(function, wrapper):
    return _wrap_as(function, wrapper, NAME)


def _wrap_generate_loop(original):
    def _generate(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except GenerationThreadDied:
            if lifeline.stopping is not None:
                return None  # woken by a stop (SIGTERM): the loop ends quietly
            raise
        except BaseException as exc:
            if threading.current_thread() is getattr(self, "_generation_thread", None):
                loaded = getattr(getattr(self, "model_provider", None), "model", None)
                during_startup = loaded is None and not heartbeat.loop_running()
                lifeline.die(self, exc, during_startup=during_startup)
            raise

    return _wrap(original, _generate)


def _wrap_generate_request(original):
    def generate(self, *args, **kwargs):
        if lifeline.dead:
            raise GenerationThreadDied(error_message())
        return original(self, *args, **kwargs)

    return _wrap(original, generate)


def _wrap_end_headers(original):
    def end_headers(self):
        self.__dict__["_mlx_hotfix_headers_sent"] = True
        return original(self)

    return _wrap(original, end_headers)


def _wrap_handle(original):
    # The whole connection, from accept to close: a request still reading
    # its body when the thread dies must be answered too.
    def handle(self, *args, **kwargs):
        lifeline.enter(self)
        try:
            return original(self, *args, **kwargs)
        finally:
            lifeline.leave(self)

    return _wrap(original, handle)


def _wrap_handle_completion(original):
    def handle_completion(self, *args, **kwargs):
        self.__dict__["_mlx_hotfix_headers_sent"] = False
        if lifeline.dead:
            return answer_dead(self)
        try:
            return original(self, *args, **kwargs)
        except GenerationThreadDied:
            answer_dead(self)

    return _wrap(original, handle_completion)


def _wrap_health(original):
    def handle_health_check(self, *args, **kwargs):
        if lifeline.dead:
            body = {"status": "unavailable", "error": error_message()}
            cause = error_cause()
            if cause is not None:
                body["cause"] = cause
            return send_json(self, 503, _with_warning(body))
        return original(self, *args, **kwargs)

    return _wrap(original, handle_health_check)


def error_cause():
    """The class of the death every waiting client is told of (the "cause" of
    the 503 body, the SSE error event and /health), or None for a stop."""
    if lifeline.stopping is not None or lifeline.cause is None:
        return None
    return cause_name(lifeline.death_class)


def answer_dead(handler):
    """Tell one client the server is going away, however far its reply got."""
    error = {"message": error_message(), "type": "server_error", "code": 503}
    cause = error_cause()
    if cause is not None:
        error["cause"] = cause
    body = _with_warning({"error": error})
    try:
        if handler.__dict__.get("_mlx_hotfix_headers_sent"):
            # A stream already said 200: end it with an error event.
            handler.wfile.write(("data: %s\n\n" % json.dumps(body)).encode())
            handler.wfile.flush()
        else:
            handler._headers_buffer = []  # drop a buffered, unsent 200
            send_json(handler, 503, body, close=True)
    except (OSError, ValueError):
        pass  # the client left
    handler.close_connection = True


def _with_warning(body):
    """body, plus the known-bad-install line when there is one: on a pair that
    dies on the first request, the answer to that request says why."""
    warning = heartbeat.warning()
    return dict(body, warning=warning) if warning else body


# -- the main thread leaving the server ----------------------------------------
#
# The server binds its port on the main thread after the generation thread
# has started. When the bind fails (the port is taken) or serve_forever
# raises, the exception leaves main(), and the interpreter then waits forever
# for the non-daemon generation thread: a process that serves nobody, yet
# beats and looks alive. sys.excepthook sees every exception that leaves the
# main thread's code, whatever the launch form, so that is where we exit.

_generation_threads = weakref.WeakSet()


def _wrap_generator_init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        thread = getattr(self, "_generation_thread", None)
        if isinstance(thread, threading.Thread):
            _generation_threads.add(thread)

    return _wrap(original, __init__)


def generation_thread_alive():
    return any(thread.is_alive() for thread in list(_generation_threads))


def _make_main_thread_excepthook(previous):
    def excepthook(exc_type, exc, tb):
        previous(exc_type, exc, tb)  # the traceback, as the user would see it
        if threading.current_thread() is not threading.main_thread():
            return
        if not generation_thread_alive():
            return
        code = config.current().exit_code
        heartbeat.stop()
        log.say(
            "the server's main thread stopped (%s: %s) while the generation thread runs; "
            "exiting %d" % (exc_type.__name__, _one_line(exc), code)
        )
        # Most often the listener could not bind (the port is taken): at start-up.
        serving = heartbeat.phase() != heartbeat.LOADING
        match = classify_death(exc)
        heartbeat.died("%s: %s" % (exc_type.__name__, _one_line(exc)), not serving,
                       cause=cause_name(match))
        extra = {"exit_code": code, "in_flight": 0, "during_startup": not serving,
                 "thread": "main"}
        extra.update(cause_fields(match))
        reports.write_report("died", exc=exc, extra=extra)
        heartbeat.notify_stopping("the server stopped listening; exiting")
        _flush_output()
        os._exit(code)

    excepthook.__wrapped__ = previous
    setattr(excepthook, _MARK, True)
    return excepthook


# -- gate and apply ----------------------------------------------------------

_RESPONSE_GENERATOR_METHODS = ("_generate", "generate")
_HANDLER_METHODS = ("handle", "handle_completion", "handle_health_check", "end_headers",
                    "do_POST")


def check_shape(server):
    return loop_shapes.check_server(server, _RESPONSE_GENERATOR_METHODS, _HANDLER_METHODS, NAME)


def apply(server):
    generator = server.ResponseGenerator
    handler = server.APIHandler
    replacements = [
        (server, "Queue", _make_watched_queue(server.Queue)),
        (generator, "_generate", _wrap_generate_loop(generator._generate)),
        (generator, "generate", _wrap_generate_request(generator.generate)),
        (handler, "handle", _wrap_handle(handler.handle)),
        (handler, "handle_completion", _wrap_handle_completion(handler.handle_completion)),
        (handler, "handle_health_check", _wrap_health(handler.handle_health_check)),
        (handler, "end_headers", _wrap_end_headers(handler.end_headers)),
    ]
    replacements.append((generator, "__init__", _wrap_generator_init(generator.__init__)))
    if not getattr(sys.excepthook, _MARK, False):
        replacements.append((sys, "excepthook", _make_main_thread_excepthook(sys.excepthook)))
    # Built first, assigned last: a failure above leaves the server untouched.
    for owner, name, value in replacements:
        setattr(owner, name, value)
    stop_signals.answer_on_stop_signals(lifeline)
