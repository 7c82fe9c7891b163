"""Time every shim wrapper on the per-token path, inside one mlx-lm venv.

Run by bench/per_token_cost.py, with the shim on PYTHONPATH:

    PYTHONPATH=sitecustomize <venv python> bench/per_token_probe.py [--calls N] [--repeats R]

Importing ``mlx_lm.server`` applies the shim as in a real server. Then, for
each hook point a generated token passes through, every layer of the chain
the shim built (a wrapper function's ``__wrapped__`` chain, or a queue
class's MRO down to ``queue.Queue``) is timed alone, on the stock code's own
objects; a wrapper's cost is its layer's time minus the next layer's:

- put:    ``rqueue.put(Response(...))`` on the generation thread (the
          heartbeat counts the delivery here);
- turn:   one ``TimeBudget.__next__`` (one decode step of the batch; with one
          request, one per token);
- get:    the request thread's ``Queue.get`` the stock handler waits in
          (0.32: ``get(timeout=1.0)``; 0.31: ``get()``);
- advance: a hybrid model's linear-attention layer per decode step
          (``ArraysCache.advance(1)`` and one read of ``lengths``), the
          ``advance`` part against stock's ``-=`` on plain attributes;
- stream: one item through ``ResponseGenerator.generate``'s stream, the real
          stock ``generate`` (its own ``Queue`` set to ``queue.Queue`` for every
          layer, so only the stream's wrappers differ), per item of a long
          stream (the per-request work is spread over it).

Each layer: R repeats of N calls, the layers interleaved within a repeat;
the figure is the minimum over the repeats of the thread's CPU time
(``time.thread_time_ns``) per call: a busy machine only ever adds time, and
the least of many short repeats is the one nothing interrupted.

Prints one JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import queue
import sys
import threading
import time
import types

import mlx_lm.server as server

_MARK = "__mlx_hotfix_wrapped__"
_FIELD_VALUES = {"text": "a", "token": 1, "state": "normal", "match": None, "logprob": -0.5,
                 "finish_reason": None, "top_tokens": ()}


def response():
    """One stock Response, whatever its fields in this release."""
    return server.Response(**{f.name: _FIELD_VALUES.get(f.name)
                              for f in dataclasses.fields(server.Response)})


def function_chain(function):
    """[(part or "stock", function)] from the outermost wrapper to stock."""
    chain = []
    while function is not None and len(chain) < 50:
        part = getattr(function, _MARK, None)
        if part is not None and not isinstance(part, str):  # marked, but not by name
            part = _part_of_module(function)
        chain.append((part or "stock", function))
        function = getattr(function, "__wrapped__", None)
    return chain


def queue_chain(cls, method):
    """[(part or "stock", class)] of the queue classes that define method, outermost
    first, ending with queue.Queue."""
    chain = []
    for klass in cls.__mro__:
        if method in vars(klass):
            part = (getattr(vars(klass)[method], _MARK, None) or vars(klass).get(_MARK)
                    or _part_of_module(klass) or "stock")
            chain.append((part if isinstance(part, str) else "stock", klass))
        if klass is queue.Queue:
            break
    return chain


def _part_of_module(klass):
    module = klass.__module__ or ""
    if module.startswith("mlx_hotfix."):
        return module.rsplit(".", 1)[1]
    return None


class Layers:
    """Times named layers, interleaved, R repeats each; min ns per call."""

    def __init__(self, calls, repeats):
        self.calls, self.repeats = calls, repeats

    def run(self, layers):
        """layers: [(label, setup() -> run(calls) -> None)] -> {label: ns per call}."""
        best = {label: None for label, _ in layers}
        for _ in range(self.repeats):
            for label, setup in layers:
                once = setup()
                t0 = time.thread_time_ns()
                once(self.calls)
                spent = (time.thread_time_ns() - t0) / self.calls
                if best[label] is None or spent < best[label]:
                    best[label] = spent
        return best


def costs(chain, best):
    """[{part, ns}] per wrapper: its layer minus the next one (stock last, 0)."""
    out = []
    for i, (part, _) in enumerate(chain[:-1]):
        out.append({"part": part, "layer": i,
                    "ns": best[i] - best[i + 1]})
    out.append({"part": "stock", "layer": len(chain) - 1, "ns": best[len(chain) - 1],
                "baseline": True})
    return out


# -- the generation thread: put and turn ------------------------------------------


def measure_generation_side(timer, result):
    from mlx_hotfix import heartbeat

    me = threading.current_thread()
    fake = types.SimpleNamespace(_generation_thread=me, _is_distributed=False)
    heartbeat.generation_thread_started(fake)  # this thread is the generation thread now
    heartbeat.loop_iteration()  # and its loop runs
    item = response()

    put_chain = queue_chain(server.Queue, "put")

    def put_layer(klass):
        def setup():
            q = klass()
            put = klass.put

            def once(n):
                for _ in range(n):
                    put(q, item)
            return once
        return setup

    best = timer.run([(i, put_layer(k)) for i, (_, k) in enumerate(put_chain)])
    result["put"] = costs(put_chain, best)

    budget_class = getattr(server, "TimeBudget", None)
    if budget_class is not None:
        turn_chain = function_chain(budget_class.__next__)

        def turn_layer(function):
            def setup():
                budget = budget_class()
                budget._budget = 1e9  # never ends within the repeat
                iter(budget)

                def once(n):
                    for _ in range(n):
                        function(budget)
                return once
            return setup

        best = timer.run([(i, turn_layer(f)) for i, (_, f) in enumerate(turn_chain)])
        result["turn"] = costs(turn_chain, best)

    measure_advance(timer, result)


def measure_advance(timer, result):
    """A hybrid model's linear-attention layer, once per decode step: ``advance(1)``
    on its ArraysCache, then its ``lengths`` read (qwen3_next reads it once per
    step). Stock: the same on an object of stock's class shape (plain attributes,
    stock's advance, whose ``-=`` adds a graph node per field per step)."""
    import mlx.core as mx
    from mlx_lm.models import cache as cache_module

    arrays = cache_module.ArraysCache
    chain = function_chain(arrays.advance)
    if len(chain) < 2:
        return  # the advance part is not applied here
    stock_advance = chain[-1][1]
    fields = {"advance": stock_advance, "__module__": __name__}
    stock_class = type("StockArraysCache", (), fields)  # plain attributes, stock's advance

    def patched():
        cache = arrays(1, left_padding=[0])
        cache.lengths = mx.array([8])
        return cache

    def stock():
        cache = stock_class()
        cache.left_padding, cache.lengths = mx.array([0]), mx.array([8])
        return cache

    def step_layer(make):
        def setup():
            cache = make()

            def once(n):
                for _ in range(n):
                    cache.advance(1)
                    lengths = cache.lengths  # noqa: F841 - the read is what is timed
            return once
        return setup

    best = timer.run([(0, step_layer(patched)), (1, step_layer(stock))])
    result["advance"] = costs([(chain[0][0], patched), ("stock", stock)], best)


# -- the request thread: get and stream ------------------------------------------


def measure_request_side(timer, result):
    item = response()
    put = queue.Queue.put  # feed without the generation side's wrappers
    waits_with_timeout = "timeout=1.0" in _source(server.ResponseGenerator, "_await_response")

    get_chain = queue_chain(server.Queue, "get")
    result["get_watched_client"] = watch_as_non_streaming(True)

    def get_layer(klass):
        def setup():
            watch_as_non_streaming(True)
            q = klass()
            for _ in range(timer.calls):
                put(q, item)
            get = klass.get

            def once(n):
                if waits_with_timeout:
                    for _ in range(n):
                        get(q, timeout=1.0)
                else:
                    for _ in range(n):
                        get(q)
            return once
        return setup

    best = timer.run([(i, get_layer(k)) for i, (_, k) in enumerate(get_chain)])
    result["get"] = costs(get_chain, best)
    watch_as_non_streaming(False)

    stream_chain = function_chain(server.ResponseGenerator.generate)
    ctx = types.SimpleNamespace(sequences={(1,): "a"}, _should_stop=False, prompt=[1],
                                prompt_cache_count=0, stop=lambda: None)

    class Requests:
        """The generator's request queue: the 'generation loop' answers at once."""

        def put(self, request):
            rqueue = request[0]
            put(rqueue, ctx)
            for _ in range(timer.calls):
                put(rqueue, item)
            put(rqueue, None)

    generator = object.__new__(server.ResponseGenerator)
    generator.requests = Requests()
    generator._generation_thread = threading.current_thread()
    generator._generation_failed = False
    generator._stop = False

    def stream_layer(function):
        def setup():
            def once(n):
                _, stream = function(generator, None, None)
                for _ in stream:
                    pass
            return once
        return setup

    stock_queue = server.Queue
    server.Queue = queue.Queue  # stock generate's queue: only the stream's wrappers differ
    try:
        best = timer.run([(i, stream_layer(f)) for i, (_, f) in enumerate(stream_chain)])
    finally:
        server.Queue = stock_queue
    result["stream"] = costs(stream_chain, best)


def watch_as_non_streaming(on):
    """The next queue made on this thread belongs to a non-streaming client that
    the disconnect part watches (its costlier case: it counts tokens on each
    get), or (on=False) to nobody watched. False where that part is not there."""
    try:
        from mlx_hotfix.patches import disconnect

        handler = types.SimpleNamespace(connection=None)
        disconnect._local.waiting = disconnect._Waiting(handler) if on else None
        return True
    except (ImportError, AttributeError, TypeError):
        return False


def _source(owner, name):
    import inspect

    try:
        return inspect.getsource(getattr(owner, name))
    except (AttributeError, OSError, TypeError):
        return ""


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    from mlx_hotfix import patches
    from mlx_hotfix.versions import mlx_lm_version

    timer = Layers(args.calls, args.repeats)
    result = {"mlx_lm": mlx_lm_version(), "python": sys.version.split()[0],
              "calls": args.calls, "repeats": args.repeats,
              "parts": dict(patches.status)}
    worker = threading.Thread(target=measure_generation_side, args=(timer, result),
                              name="generation")
    worker.start()
    worker.join()
    measure_request_side(timer, result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
