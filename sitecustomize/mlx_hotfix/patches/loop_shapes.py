"""Where mlx_lm.server's generation loop turns, release by release.

Read from every release's server.py (ARCHITECTURE.md "Patches by release"):

- before 0.28.4: no ResponseGenerator, no generation thread; requests are
  served on the HTTP threads, so a failure reaches its own client.
- 0.28.4 to 0.30.5, shape "request-queue": ``ResponseGenerator._generate``
  runs on ``_generation_thread``; each pass of its ``while not self._stop``
  loop reads the generator's own request queue (``self.requests.get`` or
  ``get_nowait``, through a closure) unless it is draining a batch. There is
  no method of its own to hook, so the queue gets one: after
  ``ResponseGenerator.__init__`` the request queue's class becomes a subclass
  with ``LoopTurn`` mixed in, whose ``get`` calls ``loop_turn()`` first. Only
  the generation loop reads that queue (clients only put), so
  ``LoopTurn.loop_turn`` runs on the generation thread alone.
- 0.30.6 and later, shape "next-request": ``_generate`` calls
  ``self._next_request(timeout)`` on every pass, and ``TimeBudget.__next__``
  on every decode step inside one pass (0.32 adds ``_run_generate`` around
  ``_generate``; the thread target changes, the loop does not).

``loop_hooks(server)`` gives the (owner, method name) pairs to wrap for "one
pass of the loop", whichever shape it is; the ``heartbeat`` part wires
the heartbeat through them, and ``exit`` checks the shape with them.
Stdlib only, like the rest of the shim.
"""

import queue

NO_THREAD = "no generation thread in this release"
_TURNS_MARK = "__mlx_hotfix_loop_turns__"


class LoopTurn:
    """Mixed into the generator's request queue on the request-queue shape."""

    def get(self, block=True, timeout=None):
        self.loop_turn()
        return super().get(block, timeout)

    def loop_turn(self):
        """One pass of the generation loop: the hook point (a no-op here)."""


_turning_classes = {}


def _turning_class(base):
    cls = _turning_classes.get(base)
    if cls is None:
        cls = type(base.__name__, (LoopTurn, base), {"__qualname__": base.__qualname__})
        _turning_classes[base] = cls
    return cls


def shape(server):
    """'next-request', 'request-queue', or None (no generation thread)."""
    generator = getattr(server, "ResponseGenerator", None)
    if generator is None or not callable(getattr(generator, "_generate", None)):
        return None
    if callable(getattr(generator, "_next_request", None)):
        return "next-request"
    return "request-queue"


def check_shape(server):
    """None if the loop has hook points this module knows, else why not."""
    kind = shape(server)
    if kind is None:
        return NO_THREAD
    if kind == "request-queue":
        queue_class = getattr(server, "Queue", None)
        if not (isinstance(queue_class, type) and issubclass(queue_class, queue.Queue)):
            return "mlx_lm.server does not use queue.Queue for its request queue"
    budget = getattr(server, "TimeBudget", None)
    if budget is not None and not callable(getattr(budget, "__next__", None)):
        return "TimeBudget is not an iterator"
    return None


def _install_request_queue_turns(generator):
    """Give every new generator's request queue the LoopTurn hook (idempotent)."""
    if getattr(generator.__init__, _TURNS_MARK, False):
        return
    original = generator.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        requests = getattr(self, "requests", None)
        # The thread already runs; it looks ``self.requests.get`` up on every
        # pass, so from its next pass on it turns through LoopTurn.
        if isinstance(requests, queue.Queue) and not isinstance(requests, LoopTurn):
            requests.__class__ = _turning_class(type(requests))

    from functools import update_wrapper  # after mlx_lm loaded (the drop-in's start-up rule)

    update_wrapper(__init__, original, assigned=("__name__", "__qualname__", "__doc__"),
                   updated=())
    setattr(__init__, _TURNS_MARK, True)
    generator.__init__ = __init__


def loop_hooks(server):
    """(owner, method_name) pairs called once per pass of the generation loop.

    On the request-queue shape this first installs the LoopTurn hook point
    (idempotent). Empty when there is no generation thread.
    """
    kind = shape(server)
    if kind is None:
        return []
    if kind == "request-queue":
        _install_request_queue_turns(server.ResponseGenerator)
        return [(LoopTurn, "loop_turn")]
    hooks = [(server.ResponseGenerator, "_next_request")]
    budget = getattr(server, "TimeBudget", None)
    if budget is not None:
        hooks.append((budget, "__next__"))
    return hooks


def check_stoppable(server, handler_methods, generator_methods):
    """The shape a part needs to stop a request as stock stops a stream
    (``ctx.stop()``): the handler, the generator, ``GenerationContext.stop``
    and the named methods. None if it fits, else why not."""
    handler = getattr(server, "APIHandler", None)
    generator = getattr(server, "ResponseGenerator", None)
    context = getattr(server, "GenerationContext", None)
    if handler is None or generator is None or context is None:
        return "mlx_lm.server has no APIHandler/ResponseGenerator/GenerationContext"
    if not callable(getattr(context, "stop", None)):
        return "GenerationContext has no stop()"
    for owner, names in ((handler, handler_methods), (generator, generator_methods)):
        for name in names:
            if not callable(getattr(owner, name, None)):
                return "%s.%s is missing" % (owner.__name__, name)
    return None


def check_server(server, generator_methods, handler_methods, part):
    """The shape both the exit and the heartbeat part need: the loop's hook
    points, the named methods, not yet wrapped by part, queue.Queue responses.
    None if it fits, else why not."""
    why = check_shape(server)
    if why is not None:
        return why
    generator = server.ResponseGenerator
    handler = getattr(server, "APIHandler", None)
    if handler is None:
        return "mlx_lm.server has no APIHandler"
    for owner, names in ((generator, generator_methods), (handler, handler_methods)):
        for name in names:
            if not callable(getattr(owner, name, None)):
                return "%s.%s is missing" % (owner.__name__, name)
    from .._wrap import wrapped_by

    if wrapped_by(generator._generate, part):
        return "already applied"
    queue_class = getattr(server, "Queue", None)
    if not (isinstance(queue_class, type) and issubclass(queue_class, queue.Queue)):
        return "mlx_lm.server does not use queue.Queue for responses"
    return None
