"""recover: opt-in (MLX_HOTFIX_RECOVER=thread). When the generation thread
dies, start a fresh one in the same process, reusing the model already
loaded, instead of exiting 70 and loading it again from disk.

Reason: ml-explore/mlx-lm#1505. The exit part turns a dead generation thread
into a clean restart, but a restart reloads the model: seconds for a small
one, minutes for a 100+ GB one, and every user waits that long. The thread
dies from bugs in one request's batch (extend, advance, slice, broadcast,
extract_cache); the model weights are untouched and can be reused.

How (the exit part's Lifeline asks this part's policy, see exit.py):
1. the exit part answers every waiting client as always (503 JSON or an SSE
   error event), each on its own thread, while the recovery goes on (it does
   not wait for them); the dying request is not retried;
2. a crash report of kind "recovered" is written when mlx_hotfix.reports
   exists (the crash-report part);
3. what the dead loop held is dropped: its frames (batch, caches) through the
   exception's traceback, and the prompt cache, which may hold a half-written
   entry (and whose lazy arrays, on mlx 0.32, belong to the dead thread's
   stream); then gc and mx.clear_cache();
4. a fresh thread runs the stock loop again on the same ResponseGenerator. The
   loop's ``load_default()`` finds the model key unchanged and loads nothing.
   On 0.32.x stock's ``_generation_failed`` is reset;
5. /health stays 503 (the Lifeline stays dead) until the fresh loop's first
   pass; meanwhile the heartbeat and systemd get stand-in beats.
At most MLX_HOTFIX_RECOVER_LIMIT recoveries in MLX_HOTFIX_RECOVER_WINDOW s;
past that, on a death during the model load, on a GPU fault (a class the
table of signatures marks gpu_fault: GPU timeout, penalty box, invalid
resource, Metal out of memory; after one, macOS rejects this process's GPU
work, so only a new process recovers), on a distributed group's failure (a
lost ring or JACCL peer: only the whole group restarted recovers), or on any
failure while recovering, the process exits 70 as without this part.

Test: tests/test_patch_recover.py (same PID, no load, same greedy output as a
fresh server; twenty deaths with no growth; past the limit exits 70; a GPU
timeout exits 70 where a slice error is recovered).
"""

import collections
import queue
import sys
import threading
import time

from .. import config, heartbeat, log
from .._wrap import wrapped_by
from . import exit as exit_part
from ._source import source_of

NAME = "recover"
TARGET = "mlx_lm.server"
REASON = "ml-explore/mlx-lm#1505: a dead generation thread costs a full model reload"
VERSIONS = ("0.31.0", "0.33.0")
FIXED_IN = None
TEST = "tests/test_patch_recover.py"
KIND = "fail-safe"

_JOIN_S = 10.0  # the dead thread has raised; it only has to unwind
_LOOP_START_S = 3600.0  # a fresh loop that loads a different default model may take long


def opted_out():
    """Why the part is off although not disabled (it is opt-in), else None."""
    settings = config.current()
    if settings.recover_mode != "thread":
        return "off (MLX_HOTFIX_RECOVER=exit: a death exits %d)" % settings.exit_code
    return None


def describe():
    settings = config.current()
    return "mode thread, at most %d in %g s" % (settings.recover_limit, settings.recover_window)


class Recovery:
    """The Lifeline's policy: recover in place within the limits, else exit."""

    def __init__(self, server, settings):
        self._server = server
        self._limit = settings.recover_limit
        self._window = settings.recover_window
        self._times = collections.deque()  # monotonic times of recent recoveries
        self._keeper_done = None
        self._worker = None
        self.recovered = 0
        self.refused = None  # why the last death was not recovered in place, for its report

    # -- called by Lifeline._reap ----------------------------------------------
    def plan(self, exc, during_startup):
        self.refused = None
        if during_startup:
            return None  # no model to reuse
        self.refused = cannot_recover_in_place(exc)
        if self.refused:
            log.say(self.refused)
            return None
        now = time.monotonic()
        while self._times and now - self._times[0] >= self._window:
            self._times.popleft()
        if len(self._times) >= self._limit:
            self.refused = "recovery limit reached (%d in %g s)" % (self._limit, self._window)
            log.say(self.refused)
            return None
        self._times.append(now)
        self._start_stand_in()
        return "recovering in place (%d of at most %d in %g s)" % (
            len(self._times), self._limit, self._window)

    def wait_loop_ended(self, thread, timeout):
        """Until the dead loop on thread has finished (its traceback printed), at
        most timeout seconds; whether it has. Stock's thread ends; the thread
        this part runs fresh loops on parks instead (a join would wait the
        whole timeout)."""
        worker = self._worker
        if worker is not None and thread is worker.thread:
            return worker.parked.wait(timeout)
        thread.join(timeout)
        return not thread.is_alive()

    def recover(self, generator, exc):
        try:
            self._recover(generator, exc)
        except Exception as error:  # noqa: BLE001 - any failure falls back to the exit
            self._stop_stand_in()
            log.say("recovery failed (%s: %s); exiting %d" % (
                error.__class__.__name__, error, config.current().exit_code))
            log.debug_exception()
            return False
        self._stop_stand_in()
        self.recovered += 1
        log.say("recovered: a fresh generation loop serves (pid unchanged, model reused)")
        return True

    # -- the steps ---------------------------------------------------------------
    def _recover(self, generator, exc):
        died_at = exit_part.lifeline.died_at
        steps = []
        dead = getattr(generator, "_generation_thread", None)
        if dead is not None and not self.wait_loop_ended(dead, _JOIN_S):
            raise RuntimeError("the dead generation loop did not finish")
        steps.append(("loop ended", time.monotonic()))
        _write_report(exc, self.recovered + 1)
        steps.append(("reported", time.monotonic()))
        self._drop_state(generator, exc)
        steps.append(("state dropped", time.monotonic()))
        del exc
        thread = self._start_loop(generator)
        deadline = time.monotonic() + _LOOP_START_S
        while not heartbeat.loop_running():
            if not thread.is_alive() or self._worker.parked.is_set():
                raise RuntimeError("the fresh generation loop died at start")
            if time.monotonic() > deadline:
                raise RuntimeError("the fresh generation loop did not start")
            time.sleep(0.02)
        steps.append(("loop running", time.monotonic()))
        exit_part.lifeline.revive()
        heartbeat.serving_again()  # last: /health says 200 only once requests are taken
        if died_at is not None:  # where a recovery's time goes (MLX_HOTFIX_DEBUG=1)
            log.debug("recovery steps, seconds after the death: " + ", ".join(
                "%s %.3f" % (name, at - died_at) for name, at in steps))

    def _drop_state(self, generator, exc):
        import gc
        import traceback

        # The dead loop's frames hold its batch generator, batch and caches.
        traceback.clear_frames(exc.__traceback__)
        exc.__traceback__ = None
        exc.__context__ = exc.__cause__ = None
        # The prompt cache goes too: an entry may be half written, and on mlx
        # 0.32 its entries are lazy arrays on the dead thread's stream, which
        # no other thread can evaluate ("There is no Stream(cpu, 0) in current
        # thread"). So the first request after a recovery prefills its whole
        # prompt, as after a restart.
        old = generator.prompt_cache
        generator.prompt_cache = type(old)(
            getattr(old, "max_size", 10), getattr(old, "max_bytes", 1 << 63))
        del old
        gc.collect()
        import mlx.core as mx

        clear = getattr(mx, "clear_cache", None) or getattr(mx.metal, "clear_cache", None)
        if clear is not None:
            clear()

    def _start_loop(self, generator):
        server = self._server
        # The dead loop's request queue got the death sentinel; a fresh one
        # that is not watched (no client waits on it; clients wait on their
        # own response queues, which the exit part watches).
        requests = server.Queue.__new__(server.Queue)
        queue.Queue.__init__(requests)
        generator.requests = requests
        budget = getattr(server, "TimeBudget", None)
        if budget is not None and hasattr(generator, "_time_budget"):
            generator._time_budget = budget()
        generator._stop = False
        if hasattr(generator, "_generation_failed"):
            generator._generation_failed = False  # 0.32.x
        heartbeat.resume()
        if self._worker is None:
            self._worker = _LoopWorker(generator)
        generator._generation_thread = self._worker.thread
        self._worker.run_once()
        return self._worker.thread

    # -- heartbeat and systemd across the swap -------------------------------------
    def _start_stand_in(self):
        heartbeat.resume()
        done = threading.Event()
        self._keeper_done = done
        interval = config.current().heartbeat_interval

        def keep():
            while not heartbeat.loop_running():
                heartbeat.stand_in()
                if done.wait(interval):
                    return

        threading.Thread(target=keep, name="mlx-hotfix-recover-beat", daemon=True).start()

    def _stop_stand_in(self):
        if self._keeper_done is not None:
            self._keeper_done.set()
            self._keeper_done = None


class _LoopWorker:
    """The thread that runs every fresh generation loop, one after another.

    One thread for all recoveries, not one each: mlx gives every thread that
    computes its own default stream and worker thread, and never frees them.
    """

    def __init__(self, generator):
        self._generator = generator
        self._target = getattr(generator, "_run_generate", None) or generator._generate
        self._go = threading.Event()
        self.parked = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mlx-hotfix-generation")
        self._started = False

    def run_once(self):
        self.parked.clear()
        self._go.set()
        if not self._started:
            self._started = True
            self.thread.start()

    def _run(self):
        while True:
            self._go.wait()
            self._go.clear()
            try:
                self._target()
            except BaseException:  # noqa: BLE001 - what stock 0.31.x leaves to the excepthook
                kind, value, trace = sys.exc_info()
                try:
                    threading.excepthook(threading.ExceptHookArgs((kind, value, trace, self.thread)))
                except Exception:  # noqa: BLE001
                    pass
                del kind, value, trace
            if self._generator._stop:
                return  # the server shuts down (stop_and_join)
            self.parked.set()


def cannot_recover_in_place(exc):
    """Why this death cannot be recovered in place (a GPU fault, a group's
    failure), or None."""
    try:
        from .. import signatures

        match = signatures.classify(exc.__class__.__name__, str(exc))
    except Exception:  # noqa: BLE001 - an unclassified death recovers as before
        return None
    entry = match.entry
    if entry.gpu_fault:
        why = "is a GPU fault; only a new process recovers from it"
    elif entry.group:
        why = "is a distributed group's failure; only the whole group restarted recovers"
    else:
        return None
    return "not recovering in place: %s (%s) %s" % (match.cls, entry.title, why)


def _write_report(exc, number):
    from .. import reports
    from .exit import cause_fields, lifeline

    in_flight = lifeline.in_flight or ()
    extra = {"recovery": number, "in_flight": len(in_flight),
             "in_flight_requests": list(in_flight)}
    extra.update(cause_fields(lifeline.death_class))  # what it was, recovered from
    try:
        from . import disconnect

        extra["cancelled"] = disconnect.cancelled_count()
    except Exception:  # noqa: BLE001
        pass
    try:
        return reports.write_report("recovered", exc=exc, extra=extra)
    except Exception:  # noqa: BLE001 - write_report never raises; be sure
        return None


# What the fresh loop is built from: the attributes stock __init__ sets.
_INIT_NEEDS = ("self.requests = Queue()", "self.prompt_cache = prompt_cache",
               "self._generation_thread = Thread(", "self._stop = False")


def check_shape(server):
    generator = getattr(server, "ResponseGenerator", None)
    if generator is None:
        return "mlx_lm.server has no ResponseGenerator"
    if not wrapped_by(getattr(generator, "_generate", None), exit_part.NAME):
        return "needs the exit part (it answers the clients and calls this part)"
    if getattr(server, "LRUPromptCache", None) is None:
        return "mlx_lm.server has no LRUPromptCache"
    source = source_of(generator.__init__)
    if source is None:
        return "cannot read the source of ResponseGenerator.__init__"
    for needed in _INIT_NEEDS:
        if needed not in source:
            return "ResponseGenerator.__init__ does not set %s" % needed
    if exit_part.lifeline.recovery is not None:
        return "already applied"
    return None


def apply(server):
    exit_part.lifeline.recovery = Recovery(server, config.current())
