"""heartbeat: liveness from delivered tokens, a heartbeat file, sd_notify and
a truthful /health, whether or not the ``exit`` part is on.

Reason: ml-explore/mlx-lm#1493 (a livelock: the loop turns, nothing is
delivered) and #1505 (a dead or hung loop that /health calls healthy). Stock
0.31.x and 0.32.x answer /health 200 while the model is still loading, 0.31.x
also after the generation thread died, and neither knows whether anyone is
being served.

How (the mechanism is mlx_hotfix.heartbeat; this module only wires it):
- ``ResponseGenerator._generate``: the generation thread starts (phase
  "loading", the keeper thread starts).
- ``ResponseGenerator._next_request`` and ``TimeBudget.__next__``: one loop
  turn each (READY=1 once, WATCHDOG=1, the heartbeat file).
- ``ModelProvider.load``: a model load reads as loading, not as a stuck loop.
- ``Queue`` (the server module's): an item put by the generation thread is a
  loop turn, and a delivery when it is for a client: a tuple is a prompt
  progress report, a ``Response`` is a generated token.
- ``ResponseGenerator.generate``: a request is in flight from here until its
  stream ends, or ``APIHandler.handle_completion`` returns, whichever is first
  (a client that hangs up mid-stream is finished too).
- ``APIHandler.handle_health_check``: 503 loading / 200 ok / 503 stalled /
  503 unavailable after a death (the ``exit`` part, when on, answers that).
  That is readiness: whether to send this server requests.
- ``APIHandler.do_GET``: ``/health/live``, liveness: 200 while the process is
  worth keeping (loading, serving, busy, draining), 503 only when stalled or
  after the generation thread died. A supervisor or a Kubernetes liveness
  probe must not kill a server that is merely loading or draining.
- A watchdog's probe (header ``X-MLX-Watchdog-Probe: 1``) is progress like
  any request, but stays out of the throughput counters (tokens, delivered,
  requests) and out of the server's log: its access line
  (``APIHandler.log_message``), its prompt-progress lines and the prompt
  cache lines the loop logs when it takes it (``_next_request``), so that a
  probe every few seconds does not fill the log or look like traffic.

Gate: shape only, no upper version bound (a fail-safe part: it observes, it
changes no result). Off switch: MLX_HOTFIX_DISABLE=heartbeat.

Test: tests/test_shim_stall.py (livelock, /health, sd_notify with exit off),
tests/test_shim_heartbeat.py, tests/test_sdnotify_server.py.
"""

import os
import sys
import threading

from .. import heartbeat
from .._wrap import _wrap, wrapped_by
from . import loop_shapes
from ._http import send_json

NAME = "heartbeat"
KIND = "fail-safe"
TARGET = "mlx_lm.server"
REASON = ("ml-explore/mlx-lm#1493, #1505: a livelocked, hung or loading server "
          "looks healthy")
VERSIONS = ("0.31.0", "0.33.0")  # tested range; a fail-safe part applies beyond it
FIXED_IN = None
TEST = "tests/test_shim_stall.py"

_local = threading.local()  # the requests a handler thread opened; is it a probe's
PROBE_HEADER = "X-MLX-Watchdog-Probe"  # sent by mlx-watchdog's probe, value "1"
_quiet_loop = False  # the generation loop is taking a probe: its INFO lines are dropped


def _is_probe(handler):
    headers = getattr(handler, "headers", None)
    try:
        return headers is not None and headers.get(PROBE_HEADER, "").strip() == "1"
    except Exception:  # noqa: BLE001 - a handler without parsed headers
        return False


class _QuietProbes:
    """A root-logger filter: the stock server's INFO lines about a probe go."""

    def filter(self, record):
        if record.levelno != 20:  # logging.INFO; warnings and errors always pass
            return True
        if heartbeat.on_generation_thread():
            return not _quiet_loop
        return not getattr(_local, "probe", False)


class _Request:
    """One client's request in flight; finished exactly once."""

    __slots__ = ("done", "probe")

    def __init__(self):
        self.done = False
        self.probe = getattr(_local, "probe", False)
        heartbeat.request_started()
        opened = getattr(_local, "opened", None)
        if opened is not None:
            opened.append(self)

    def finish(self):
        if not self.done:
            self.done = True
            heartbeat.request_finished(counted=not self.probe)


def _until_done(stream, request):
    try:
        yield from stream
    finally:
        request.finish()


def _make_delivery_queue(base, response_class):
    # Bound here, not looked up per call: this put runs once per token.
    base_put = base.put
    loop_put = heartbeat.loop_put
    token, prompt = heartbeat.TOKEN, heartbeat.PROMPT

    class _DeliveryQueue(base):
        """Counts what the generation thread puts for clients."""

        _mlx_hotfix_probe = False  # also for a queue made without __init__ (recover's)

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # Made by the handler thread of the request it answers.
            self._mlx_hotfix_probe = getattr(_local, "probe", False)

        def put(self, item, block=True, timeout=None):
            # A Response is a generated token, a tuple a prompt progress report;
            # loop_put ignores every thread but the generation thread.
            if isinstance(item, response_class):
                loop_put(token, not self._mlx_hotfix_probe)
            elif isinstance(item, tuple):
                loop_put(prompt, not self._mlx_hotfix_probe)
            else:
                loop_put(None)
            base_put(self, item, block, timeout)

    _DeliveryQueue.__name__ = base.__name__
    _DeliveryQueue.__qualname__ = base.__qualname__
    _wrap(base.put, _DeliveryQueue.put, NAME)
    return _DeliveryQueue


def _wrap_generate_loop(original):
    def _generate(self, *args, **kwargs):
        heartbeat.generation_thread_started(self)
        return original(self, *args, **kwargs)

    return _wrap(original, _generate, NAME)


def _wrap_loop_turn(original):
    loop_iteration = heartbeat.loop_iteration  # once per decode step: no lookup per call

    if original.__name__ == "__next__":  # TimeBudget's: no arguments to pass on
        def turn(self):
            loop_iteration()
            return original(self)
    else:
        def turn(self, *args, **kwargs):
            loop_iteration()
            return original(self, *args, **kwargs)

    return _wrap(original, turn, NAME)


def _wrap_model_load(original):
    def load(self, *args, **kwargs):
        with heartbeat.model_load():
            return original(self, *args, **kwargs)

    return _wrap(original, load, NAME)


def _wrap_generate_request(original):
    def generate(self, *args, **kwargs):
        request = _Request()
        try:
            result = original(self, *args, **kwargs)
        except BaseException:
            request.finish()
            raise
        if isinstance(result, tuple) and len(result) == 2:
            ctx, stream = result
            return ctx, _until_done(stream, request)
        return result  # an unknown shape: handle_completion finishes it

    return _wrap(original, generate, NAME)


def _wrap_handle_completion(original):
    def handle_completion(self, *args, **kwargs):
        outer = getattr(_local, "opened", None)
        _local.opened = []
        _local.probe = _is_probe(self)
        try:
            return original(self, *args, **kwargs)
        finally:
            for request in _local.opened:
                request.finish()
            _local.opened = outer
            _local.probe = False

    return _wrap(original, handle_completion, NAME)


def _wrap_next_request(original):
    # The loop took a request: while it sets a probe up, its INFO lines go.
    def _next_request(self, *args, **kwargs):
        global _quiet_loop
        request = original(self, *args, **kwargs)
        if request is not None:
            queue = request[0] if isinstance(request, tuple) and request else None
            _quiet_loop = bool(getattr(queue, "_mlx_hotfix_probe", False))
        return request

    return _wrap(original, _next_request, NAME)


def _wrap_log_message(original):
    def log_message(self, *args, **kwargs):
        if _is_probe(self):
            return None  # the access line of a watchdog's probe
        return original(self, *args, **kwargs)

    return _wrap(original, log_message, NAME)


def _generation_dead(handler):
    generator = getattr(handler, "response_generator", None)
    thread = getattr(generator, "_generation_thread", None)
    if getattr(generator, "_generation_failed", False):
        return True
    return thread is not None and not thread.is_alive()


def _wrap_health(original):
    def handle_health_check(self, *args, **kwargs):
        answer = heartbeat.health()
        if answer is None:  # the exit part took over after a death
            return original(self, *args, **kwargs)
        if _generation_dead(self):
            answer = 503, {"status": "unavailable", "error": "generation thread died"}
        status, body = answer
        if heartbeat.warning():  # a known-bad install: say so to every probe
            body = dict(body, warning=heartbeat.warning())
        send_json(self, status, body)

    return _wrap(original, handle_health_check, NAME)


LIVENESS_PATH = "/health/live"


def liveness(handler):
    """(status, body) for /health/live."""
    answer = heartbeat.health()
    if answer is None or _generation_dead(handler):
        return 503, {"status": "unavailable", "error": "generation thread died or stopping"}
    _, body = answer
    if body.get("status") == "stalled":
        return 503, body
    from .drain import draining

    # Above the memory soft line /health says 503 too, but the server serves.
    phase = "draining" if draining() else (
        "loading" if body.get("status") == "loading" else "serving")
    return 200, {"status": "alive", "phase": phase}


def _wrap_do_get(original):
    def do_GET(self, *args, **kwargs):
        if str(getattr(self, "path", "")).split("?", 1)[0] == LIVENESS_PATH:
            status, body = liveness(self)
            return send_json(self, status, body)
        return original(self, *args, **kwargs)

    return _wrap(original, do_GET, NAME)


def _wrap_server_activate(original):
    # HTTPServer binds in __init__ and then listens here: from now on the
    # server can take clients, which "serving" and READY=1 need.
    def server_activate(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if serves_mlx_lm(self):
            heartbeat.listener_bound()
        return result

    return _wrap(original, server_activate, NAME)


def serves_mlx_lm(httpd):
    """The listener's handler factory comes from mlx_lm's server.py (any launch form)."""
    factory = getattr(httpd, "RequestHandlerClass", None)
    code = getattr(factory, "__code__", None)
    filename = getattr(code, "co_filename", None) or getattr(
        sys.modules.get(getattr(factory, "__module__", None) or ""), "__file__", "")
    return str(filename).replace(os.sep, "/").endswith("mlx_lm/server.py")


# -- gate and apply ----------------------------------------------------------


def check_shape(server):
    why = loop_shapes.check_server(server, ("_generate", "generate"),
                                   ("handle_completion", "handle_health_check"), NAME)
    if why is None and not isinstance(getattr(server, "Response", None), type):
        why = "mlx_lm.server has no Response class to count tokens by"
    return why


def apply(server):
    generator = server.ResponseGenerator
    handler = server.APIHandler
    provider = getattr(server, "ModelProvider", None)
    replacements = [
        (server, "Queue", _make_delivery_queue(server.Queue, server.Response)),
        (generator, "_generate", _wrap_generate_loop(generator._generate)),
        (generator, "generate", _wrap_generate_request(generator.generate)),
        (handler, "handle_completion", _wrap_handle_completion(handler.handle_completion)),
        (handler, "handle_health_check", _wrap_health(handler.handle_health_check)),
    ]
    if callable(getattr(handler, "do_GET", None)):
        replacements.append((handler, "do_GET", _wrap_do_get(handler.do_GET)))
    for owner, name in loop_shapes.loop_hooks(server):
        method = getattr(owner, name)
        if owner is generator and name == "_next_request":
            method = _wrap_next_request(method)
        replacements.append((owner, name, _wrap_loop_turn(method)))
    if callable(getattr(handler, "log_message", None)):
        replacements.append((handler, "log_message", _wrap_log_message(handler.log_message)))
    if provider is not None and callable(getattr(provider, "load", None)):
        replacements.append((provider, "load", _wrap_model_load(provider.load)))
    listener = getattr(server, "ThreadingHTTPServer", None)
    if isinstance(listener, type) and callable(getattr(listener, "server_activate", None)):
        if not wrapped_by(listener.server_activate, NAME):
            replacements.append(
                (listener, "server_activate", _wrap_server_activate(listener.server_activate)))
    # Built first, assigned last: a failure above leaves the server untouched.
    for owner, name, value in replacements:
        setattr(owner, name, value)
    if any(name == "server_activate" for _, name, _ in replacements):
        heartbeat.watch_listener()
    import logging

    logging.getLogger().addFilter(_QuietProbes())
