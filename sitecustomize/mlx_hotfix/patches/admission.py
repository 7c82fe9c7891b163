"""admission: a bounded queue, a queue deadline and a request deadline, and
the counts of requests waiting for a slot apart from those generating.

Reason: stock mlx_lm.server accepts every request and queues it without limit
and without time (no upstream setting exists; peers have them: Ollama
OLLAMA_MAX_QUEUE, SGLang SGLANG_REQ_WAITING_TIMEOUT, llama.cpp
t_max_predict_ms, vLLM's num_requests_waiting). Under a burst the last
client waits many service times, times out, retries and adds load; a
100,000-token request holds a decode slot as long as it likes.

How (the mechanism is mlx_hotfix.admission; this module wires it):
- ``APIHandler.handle_completion``: a request waits in admission's line until
  a slot is free, or is refused: ``503`` with ``Retry-After`` and an
  OpenAI-style body (type ``server_busy``) when the line is full
  (MLX_HOTFIX_MAX_QUEUE) or it waited MLX_HOTFIX_QUEUE_TIMEOUT. Stock never
  sees a refused request. The slot is free again when its stream ends or the
  handler returns. A probe (``X-MLX-Watchdog-Probe: 1``, max_tokens 1) skips
  the line.
- ``Queue`` (the server module's): the response queue a request's handler
  reads knows the request. It notes the request's ``GenerationContext``, and
  at the request deadline (MLX_HOTFIX_REQUEST_TIMEOUT from its arrival, or
  a lower ``X-Request-Timeout`` header) it calls ``ctx.stop()``, as stock
  does for a stream whose client left, and ends the stream after what was
  generated so far.
- ``APIHandler.generate_response``: such a cut answer ends with
  ``finish_reason: "length"`` (streaming: the last chunk, then ``[DONE]``).
- ``TimeBudget.__next__`` (0.30.6 on): when a request leaves the line for a
  freed slot while others still decode, or one is cut at its deadline, the
  current decode budget (up to 0.5 s) ends early, so the loop takes the new
  one (as stock's own queue would) or drops the cut one at once.

Slots: stock decodes at most ``max(--decode-concurrency,
--prompt-concurrency)`` requests of a batchable model at once, one request
of any other (``_is_batchable``). A request stock cannot batch (a ``seed``)
waits inside stock for the batch to drain, counted as running.

Gate: shape only (the hook points above; ``--decode-concurrency`` in the
loop, from 0.30.x). With no setting it changes no answer; its settings
refuse and cut on purpose. Off switch: MLX_HOTFIX_DISABLE=admission.

Test: tests/test_patch_admission.py (the storm with stock as control in the
same run, the queue deadline, the request deadline, the OpenAI client, the
watchdog under the storm).
"""

import queue
import threading
import time
import types

from .. import admission, config, heartbeat
from .._wrap import _wrap as _wrap_as
from .._wrap import wrapped_by
from . import loop_shapes
from ._http import send_json
from ._source import source_of

NAME = "admission"
TARGET = "mlx_lm.server"
REASON = ("no upstream issue: stock queues every request without limit or time "
          "(peers: Ollama OLLAMA_MAX_QUEUE, SGLang SGLANG_REQ_WAITING_TIMEOUT)")
VERSIONS = ("0.31.0", "0.33.0")
FIXED_IN = None
TEST = "tests/test_patch_admission.py"
KIND = "fail-safe"  # hook points only; its settings change answers on purpose

PROBE_HEADER = "X-MLX-Watchdog-Probe"  # the watchdog's probe says who it is
TIMEOUT_HEADER = "X-Request-Timeout"

_local = threading.local()  # the ticket of the request this handler thread serves
gate = None
_generator = None  # the server's ResponseGenerator, for the slot count
_wake_loop = False  # end the current decode budget: the loop has something to do
_distributed_said = False


def describe():
    settings = config.current()
    return admission.describe(settings.max_queue, settings.queue_timeout,
                              settings.request_timeout)


# -- the slots ------------------------------------------------------------------


def _slots():
    """How many requests stock generates at once (see the module docstring)."""
    generator = _generator
    if generator is None:
        return 1
    try:
        batchable = generator._is_batchable(types.SimpleNamespace(seed=None))
    except Exception:  # noqa: BLE001 - a release whose check wants more: the provider's word
        batchable = getattr(getattr(generator, "model_provider", None), "is_batchable", False)
    if not batchable:
        return 1
    args = generator.cli_args
    return max(int(args.decode_concurrency), int(args.prompt_concurrency), 1)


def _end_budget():
    """The loop should look at its requests now: one left our line for a freed
    slot, or one was cut at its deadline (stock drops a stopped request only
    after its decode budget, up to 0.5 s of tokens for nobody)."""
    global _wake_loop
    _wake_loop = True


# -- the request ----------------------------------------------------------------


def _is_probe(handler):
    headers = getattr(handler, "headers", None)
    if headers is None or (headers.get(PROBE_HEADER) or "").strip() != "1":
        return False
    tokens = getattr(handler, "max_tokens", None)
    # Only a one-token request skips the line: a header alone cannot buy a slot.
    return isinstance(tokens, int) and not isinstance(tokens, bool) and tokens <= 1


def _ticket_for(handler):
    """The request's ticket; ValueError for a bad X-Request-Timeout."""
    global _distributed_said
    settings = config.current()
    timeout = settings.request_timeout
    raw = handler.headers.get(TIMEOUT_HEADER) if getattr(handler, "headers", None) else None
    if raw is not None:
        asked = admission.parse_timeout_header(raw)
        timeout = asked if timeout is None else min(timeout, asked)  # lower, never raise
    if timeout is not None and getattr(_generator, "_is_distributed", False):
        # Stock cannot stop an unbatched request in a group (NotImplementedError
        # on the generation thread): no deadline there rather than a death.
        if not _distributed_said:
            _distributed_said = True
            from .. import log

            log.say("admission: request deadlines are off in a distributed group "
                    "(stock cannot stop an unbatched request there)")
        timeout = None
    return admission.Ticket(request_timeout=timeout, queue_timeout=settings.queue_timeout,
                            probe=_is_probe(handler))


def _serving(handler):
    """False once the server cannot serve (a death, a stop): waiting requests
    then leave the line for the server's own answer."""
    from . import exit as exit_part

    if exit_part.lifeline.dead:
        return False
    generator = getattr(handler, "response_generator", None)
    available = getattr(generator, "generation_available", None)
    if callable(available):
        return bool(available())
    thread = getattr(generator, "_generation_thread", None)
    return thread is None or thread.is_alive()


def _refuse(handler, refusal):
    queued, running = gate.counts()
    body = {
        "error": {"message": refusal.message, "type": admission.BUSY_TYPE, "code": 503,
                  "reason": refusal.reason},
        "queued": queued,
        "running": running,
        # Deliveries going on: busy, not wedged (the watchdog's judge reads it).
        "last_delivery_age_s": heartbeat.last_delivery_age(),
    }
    try:
        send_json(handler, 503, body, retry_after=refusal.retry_after)
    except (OSError, ValueError):
        handler.close_connection = True  # the client left


def _bad_request(handler, message):
    body = {"error": {"message": message, "type": "invalid_request_error", "code": 400}}
    try:
        send_json(handler, 400, body)
    except (OSError, ValueError):
        handler.close_connection = True


def _wrap(function, wrapper):
    return _wrap_as(function, wrapper, NAME)


def _wrap_handle_completion(original):
    def handle_completion(self, *args, **kwargs):
        global _generator
        if getattr(_local, "ticket", None) is not None:
            return original(self, *args, **kwargs)  # re-entered: already admitted
        _generator = getattr(self, "response_generator", None) or _generator
        try:
            ticket = _ticket_for(self)
        except ValueError as exc:
            return _bad_request(self, str(exc))
        try:
            gate.admit(ticket, serving=lambda: _serving(self))
        except admission.Refused as refusal:
            return _refuse(self, refusal)
        _local.ticket = ticket
        try:
            return original(self, *args, **kwargs)
        finally:
            _local.ticket = None
            gate.release(ticket)

    return _wrap(original, handle_completion)


def _wrap_generate_response(original):
    def generate_response(self, text, finish_reason, *args, **kwargs):
        ticket = getattr(_local, "ticket", None)
        if ticket is not None and ticket.cut and finish_reason is not None:
            finish_reason = "length"  # cut short by a limit, as max_tokens would
        return original(self, text, finish_reason, *args, **kwargs)

    return _wrap(original, generate_response)


def _make_deadline_queue(base, context_class):
    class _DeadlineQueue(base):
        """A response queue that knows its request: the context, the end of
        its stream (its slot frees), and its deadline."""

        _mlx_hotfix_ticket = None

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            ticket = getattr(_local, "ticket", None)
            self._mlx_hotfix_ticket = None
            if ticket is not None and ticket.ctx is None and not ticket.probe:
                self._mlx_hotfix_ticket = ticket
                if ticket.waited:
                    _end_budget()  # stock's generate puts the request right after this

        def get(self, block=True, timeout=None):
            ticket = self._mlx_hotfix_ticket
            if ticket is None:
                return super().get(block, timeout)
            if ticket.deadline is not None and ticket.ctx is not None and not ticket.cut:
                left = ticket.deadline - time.monotonic()
                if left <= 0:
                    self._cut(ticket)
                elif block and (timeout is None or timeout > left):
                    try:
                        return self._seen(ticket, super().get(True, left))
                    except queue.Empty:
                        self._cut(ticket)
            return self._seen(ticket, super().get(block, timeout))

        def _cut(self, ticket):
            # As stock stops a stream whose client left; the end marker goes
            # after what is already generated, and through every reader above.
            ticket.cut = True
            ticket.ctx.stop()
            _end_budget()
            self.put(None)
            gate.deadline_stop()

        def _seen(self, ticket, item):
            if ticket.ctx is None and isinstance(item, context_class):
                ticket.ctx = item
            elif item is None or isinstance(item, Exception):
                gate.release(ticket)  # the stream ended: the slot is free
            return item

    _DeadlineQueue.__name__ = base.__name__
    _DeadlineQueue.__qualname__ = base.__qualname__
    _DeadlineQueue._mlx_hotfix_admission = True
    return _DeadlineQueue


def _wrap_budget_next(original):
    def __next__(self):
        global _wake_loop
        if _wake_loop and not getattr(self, "_is_distributed", True):
            _wake_loop = False
            raise StopIteration  # the loop reads its request queue next
        return original(self)

    return _wrap(original, __next__)


# -- gate and apply ----------------------------------------------------------------


def check_shape(server):
    why = loop_shapes.check_stoppable(server, ("handle_completion", "generate_response"),
                                      ("generate", "_generate", "_is_batchable"))
    if why is not None:
        return why
    handler, generator = server.APIHandler, server.ResponseGenerator
    if wrapped_by(handler.handle_completion, NAME):
        return "already applied"
    if not (isinstance(server.Queue, type) and issubclass(server.Queue, queue.Queue)):
        return "mlx_lm.server does not use queue.Queue for responses"
    loop = source_of(generator._generate)
    if loop is None:
        return "cannot read the source of ResponseGenerator._generate"
    if "decode_concurrency" not in loop or "prompt_concurrency" not in loop:
        return "no --decode-concurrency/--prompt-concurrency: cannot tell the slots"
    import inspect

    try:
        names = list(inspect.signature(handler.generate_response).parameters)[:3]
    except (TypeError, ValueError):
        names = []
    if names != ["self", "text", "finish_reason"]:
        return "APIHandler.generate_response is not (self, text, finish_reason, ...)"
    return None


def apply(server):
    global gate
    settings = config.current()
    handler = server.APIHandler
    replacements = [
        (server, "Queue", _make_deadline_queue(server.Queue, server.GenerationContext)),
        (handler, "handle_completion", _wrap_handle_completion(handler.handle_completion)),
        (handler, "generate_response", _wrap_generate_response(handler.generate_response)),
    ]
    budget = getattr(server, "TimeBudget", None)
    if isinstance(budget, type) and callable(getattr(budget, "__next__", None)):
        replacements.append((budget, "__next__", _wrap_budget_next(budget.__next__)))
    new_gate = admission.Gate(max_queue=settings.max_queue, summary=admission.Summary())
    new_gate.slots = _slots
    # Built first, assigned last: a failure above leaves the server untouched.
    gate = new_gate
    for owner, name, value in replacements:
        setattr(owner, name, value)
    heartbeat.add_fields(gate.fields)
