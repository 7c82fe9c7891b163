"""The server's heartbeat: is anyone being served? State and writing only.

The ``heartbeat`` patch (patches/heartbeat.py) feeds this module; other parts
may call the small public functions too. Liveness is *delivery*, not loop
turns: a loop that keeps turning while it delivers nothing (a livelock,
upstream #1493) is as stuck as one that stopped.

Fed by the patch:
    generation_thread_started(generator)   top of ResponseGenerator._generate
    loop_iteration()                       each pass of the generation loop
    model_load()                           context manager around a model load
    request_started() / request_finished() a client's request is waiting / done
    loop_put(TOKEN | PROMPT | None)        one item put on a response queue (a loop
                                           turn and, with a kind, a delivery)
    delivered("prompt" | "token")          a delivery alone
    cancelled()                            a request was cancelled
    stop()                                 the generation thread died

Phases: "loading" until the model is loaded and the loop runs (and during a
model load inside the loop); "stalled" when requests are in flight and
nothing was delivered for MLX_HOTFIX_STALL_TIMEOUT seconds, or the loop has
not turned for that long; "serving" otherwise.

At most once per MLX_HOTFIX_HEARTBEAT_INTERVAL the loop rewrites
MLX_HOTFIX_HEARTBEAT_FILE (one JSON line, see ``record``) and systemd gets
WATCHDOG=1 (READY=1 once). A light keeper thread decides the stall when the
loop cannot (a hard hang), keeps the file fresh during a model load, and
writes "stalled" while stalled. While stalled no WATCHDOG=1 is sent, so
systemd's WatchdogSec= acts; when the loop hangs without requests in flight
the file simply stops changing until the stall timeout, as before.
"""

import json
import os
import threading
import time

from . import config, memory
from ._files import write_atomically

# Bound once: the per-token path (loop_put, loop_iteration) reads no module
# attribute it can avoid.
_monotonic = time.monotonic
_get_ident = threading.get_ident

LOADING, SERVING, STALLED = "loading", "serving", "stalled"

_started = time.time()  # the shim's start in this process (first import of mlx_lm)
_generation_ident = None
_rank = None
_loop_running = False
_loading = False  # a model load is running on the generation thread
_stopped = False
_beats = 0
_next_write = 0.0
_next_ping = 0.0  # monotonic; when the loop next offers systemd a WATCHDOG=1
_notifier = None
_keeper = None
_keeper_wake = threading.Event()  # set by resume(): the old keeper ends now, not a tick later
_epoch = 0  # one per generation loop; a recovery starts the next
_write_lock = threading.Lock()  # the loop and the keeper share the temp file
_count_lock = threading.Lock()  # request threads start and finish requests

# Delivery bookkeeping. The generation thread alone writes the delivery
# counters; request threads change in_flight under _count_lock.
_in_flight = 0
_delivered = 0
_prompt_tokens = 0
_decode_tokens = 0
_requests = 0
_cancelled = 0
_last_delivery_mono = None  # the last delivery (the record gives it as unix time)
_progress_mono = time.monotonic()  # last delivery, first request in flight, load end
_beat_mono = time.monotonic()  # last loop turn
_stalled = False
_down = False  # the generation loop died; set by stop(), cleared by serving_again()
_death = None  # why the process is about to exit (died()), in every later record


def _systemd():
    global _notifier
    if _notifier is None:
        if os.environ.get("NOTIFY_SOCKET"):
            from .sdnotify import SdNotifier

            _notifier = SdNotifier.from_environ()
        else:
            _notifier = False
    return _notifier or None


_who = None


def _identity():
    """{"rank", "host"}: which member of an mlx.launch group this is (group.py)."""
    global _who
    if _who is None:
        from .group import identity

        _who = identity()
    return _who


_UNSET = object()
_warning = _UNSET


def warning():
    """The one-line known-bad-pair or yanked-release warning, or None.

    Sent in the record and in /health so that `mlx-watchdog probe` and
    `status` can say why a server dies on its first request (issue 12).
    Worked out once, after mlx_lm loaded (its version is known by then).
    """
    global _warning
    if _warning is _UNSET:
        try:
            from .versions import pairing_warning

            _warning = pairing_warning()
        except Exception:  # noqa: BLE001 - a warning never costs a beat
            _warning = None
    return _warning


def record(phase):
    """The heartbeat record (the contract other tools read; fields only grow)."""
    data = {
        "pid": os.getpid(),
        "started": _started,
        "beats": _beats,
        "time": time.time(),
        "phase": phase,
        "in_flight": _in_flight,
        "delivered": _delivered,
        "last_delivery": _unix_time(_last_delivery_mono),
        "prompt_tokens": _prompt_tokens,
        "decode_tokens": _decode_tokens,
        "requests": _requests,
        "cancelled": _cancelled,
        "rank": _rank if _rank is not None else _identity().get("rank"),
        "host": _identity().get("host"),
    }
    if warning():
        data["warning"] = warning()
    # memory.py: sampled once per interval; the loop's own beat may serve a trim.
    data["memory"] = memory.fields(trim_point=on_generation_thread() and not _stopped)
    _add_fields(data)
    return data


def _unix_time(mono):
    """The unix time of monotonic time mono (None stays None): the loop keeps one
    clock per token, the record converts when it is written."""
    return None if mono is None else time.time() - (time.monotonic() - mono)


_field_sources = []  # other parts' fields for the record and /health (admission's counts)


def add_fields(source):
    """source() -> a dict of fields to add to every record and /health body."""
    if source not in _field_sources:
        _field_sources.append(source)


def _add_fields(data):
    for source in _field_sources:
        try:
            data.update(source())
        except Exception:  # noqa: BLE001 - another part's fields never cost a beat
            pass


def health_fields():
    """The fields every /health body of a running server carries besides its
    own: memory, and other parts' (admission's counts). For a part that
    answers /health itself (the drain)."""
    data = {"memory": memory.fields()}
    _add_fields(data)
    return data


def _write(data):
    """Write one record to the heartbeat file, atomically. Never raises."""
    path = config.current().heartbeat_file
    if not path:
        return
    with _write_lock:
        if _death is not None:  # a write racing the death's must not drop its cause
            data = dict(data, death=_death)
        try:
            write_atomically(path, json.dumps(data) + "\n", mode=0o644)  # a watchdog of another user reads it
        except OSError as exc:
            _warn_unwritable(path, exc)  # a full disk must not kill the loop


_warned_unwritable = False


def _warn_unwritable(path, exc):
    """Say once that the heartbeat cannot be written: a silent stale file
    would read as a hung loop to a watchdog."""
    global _warned_unwritable
    if _warned_unwritable:
        return
    _warned_unwritable = True
    from . import log

    log.say(
        "cannot write the heartbeat file %s (%s); watchdogs will not see this server's "
        "progress (said once)" % (path, getattr(exc, "strerror", None) or exc)
    )


# -- the listener: "serving" needs a bound listener as well as a running loop --

_listener_hooked = False  # a patch watches the server's listener
_listener_bound = False


def watch_listener():
    """A patch will call listener_bound() once the server listens. Until it
    does, READY=1 and phase "serving" wait for it (a process whose bind
    failed serves nobody). Without such a patch, the loop alone decides."""
    global _listener_hooked
    _listener_hooked = True


def listener_bound():
    """The server's HTTP listener is bound and listening."""
    global _listener_bound
    if _listener_bound:
        return
    _listener_bound = True
    if _loop_running and not _stopped:
        _announce_ready()


def listening():
    # Only rank 0 of an mlx.launch group listens; the other ranks serve it.
    return _listener_bound or not _listener_hooked or (_identity().get("rank") or 0) > 0


def _announce_ready():
    notifier = _systemd()
    if notifier is not None:
        notifier.ready("serving")


def _beat_file(phase):
    if not _stopped and config.current().heartbeat_file:
        _write(record(phase))


# -- the phase and the stall decision ----------------------------------------


def phase():
    if not _loop_running or _loading or not listening():
        return LOADING  # a loop without a listener serves nobody
    return STALLED if _stalled else SERVING


_stall_lock = threading.Lock()
_stall_decided = 0.0  # the monotonic time of the latest stall decision


def _check_stall(now):
    """Decide the stall at monotonic time now; returns whether stalled.

    The loop, the keeper and /health handlers all ask. One decision at a time
    (the lock), in time order: a caller whose clock reading is older than the
    latest decision's (read before another thread decided) decides at that
    time instead, so a stall is never un-decided and announced again by a
    stale reading. Each change is announced exactly once.
    """
    global _stalled, _stall_decided
    with _stall_lock:
        now = max(now, _stall_decided)
        _stall_decided = now
        if not _loop_running or _loading or _stopped:
            stalled = False
        else:
            limit = config.current().stall_timeout
            waiting = _in_flight > 0 and now - _progress_mono > limit
            silent = now - _beat_mono > limit
            stalled = waiting or silent
        if stalled != _stalled:
            _stalled = stalled
            _announce(stalled, now)
    return stalled


def _announce(stalled, now):
    from . import log

    notifier = _systemd()
    if stalled:
        text = "stalled: %d request(s) in flight, nothing delivered for %.0fs" % (
            _in_flight, now - _progress_mono)
        if now - _beat_mono > config.current().stall_timeout:
            text = "stalled: the generation loop has not turned for %.0fs" % (now - _beat_mono)
        log.say(text + "; WATCHDOG=1 pings stop")
    else:
        text = "serving: delivering again"
        log.say(text)
    if notifier is not None:
        notifier.status(text)


def health():
    """(status, body) for /health, or None to let the server answer."""
    if _stopped or _down:
        return None  # the loop died: the exit part answers (503) until serving_again()
    now = time.monotonic()
    current = LOADING if (not _loop_running or _loading or not listening()) else (
        STALLED if _check_stall(now) else SERVING)
    if current == LOADING:
        return 503, {"status": "loading", "memory": memory.fields()}
    age = None if _last_delivery_mono is None else round(now - _last_delivery_mono, 3)
    body = {"in_flight": _in_flight, "last_delivery_age_s": age, "memory": memory.fields()}
    _add_fields(body)
    if current == STALLED:
        body = dict(status="stalled", stall_timeout_s=config.current().stall_timeout, **body)
        return 503, body
    if memory.soft():  # the watchdog's soft line: new work goes elsewhere
        return 503, dict(status="memory", **body)
    return 200, dict(status="ok", **body)


# -- fed by the patch ----------------------------------------------------------


def generation_thread_started(generator):
    """Called at the top of ResponseGenerator._generate."""
    global _generation_ident, _rank
    if threading.current_thread() is not getattr(generator, "_generation_thread", None):
        return
    _generation_ident = threading.get_ident()
    memory.attach(generator)
    if getattr(generator, "_is_distributed", False):
        _rank = getattr(generator, "_rank", None)
    _beat_file(LOADING)
    notifier = _systemd()
    if notifier is not None:
        notifier.status("loading the model")
    _start_keeper()


def loop_running():
    return _loop_running


def on_generation_thread():
    return _generation_ident is not None and threading.get_ident() == _generation_ident


class model_load:
    """Context manager around ModelProvider.load on the generation thread: a
    load is one long call with no loop turns, and reads as loading (the
    keeper keeps the file fresh and systemd fed meanwhile)."""

    def __enter__(self):
        global _loading
        self._active = on_generation_thread() and not _stopped
        if self._active:
            _loading = True
            _beat_file(LOADING)
        return self

    def __exit__(self, *exc_info):
        global _loading, _progress_mono, _beat_mono
        if self._active:
            _progress_mono = _beat_mono = time.monotonic()
            _loading = False
            if _loop_running:
                _beat_file(phase())
        return False


def loop_iteration():
    """One pass of the generation loop: cheap, called very often."""
    global _beats, _beat_mono
    if _stopped:
        return
    _beats += 1
    _beat_mono = now = _monotonic()
    if now >= _next_write or now >= _next_ping or not _loop_running:
        _turn_work(now)


def loop_put(kind, counted=True):
    """An item put on a response queue: kind TOKEN (a generated token), PROMPT
    (a prompt progress report) or None (a context, an end, an error). From the
    generation thread it is a loop turn (a long single-request stream turns no
    other hook), and a delivery when kind is set (counted=False: a watchdog's
    probe, progress but not throughput); from any other thread (a client
    queueing its request) it is nothing. The per-token path: one clock
    read and a few counters, the rest once per interval (``_turn_work``)."""
    global _beats, _beat_mono
    if _get_ident() != _generation_ident:
        return
    now = _monotonic()
    if kind is not None:
        _count_delivery(kind, now, counted)
    if _stopped:
        return
    # loop_iteration()'s body, with the clock already read (one call less per token)
    _beats += 1
    _beat_mono = now
    if now >= _next_write or now >= _next_ping or not _loop_running:
        _turn_work(now)


def _turn_work(now):
    """What a loop turn does at most once per interval: READY=1 on the first
    turn, WATCHDOG=1 (a few times per systemd's ping interval), the stall
    decision and the heartbeat file."""
    global _loop_running, _next_write, _next_ping, _progress_mono
    notifier = _systemd()
    if not _loop_running:
        _progress_mono = now
        _loop_running = True
        if notifier is not None and listening():
            notifier.ready("serving")
    if now >= _next_ping:
        if notifier is None:
            _next_ping = float("inf")
        else:
            if not _stalled:
                notifier.watchdog_ping()  # rate-limited inside
            # A quarter of the ping interval: a ping is late by at most that.
            _next_ping = now + notifier.min_interval / 4
    if now >= _next_write:
        _next_write = now + config.current().heartbeat_interval
        _check_stall(now)
        _beat_file(phase())


TOKEN, PROMPT = "token", "prompt"


def delivered(kind, counted=True):
    """One item for a client left the generation thread: "prompt" (a prompt
    progress report) or "token" (a generated token). counted=False (a
    watchdog's probe): progress all the same, but not throughput."""
    _count_delivery(kind, _monotonic(), counted)


def _count_delivery(kind, now, counted):
    global _delivered, _prompt_tokens, _decode_tokens
    global _last_delivery_mono, _progress_mono
    if counted:
        _delivered += 1
        if kind == TOKEN:
            _decode_tokens += 1
        else:
            _prompt_tokens += 1
    _last_delivery_mono = _progress_mono = now
    if _stalled:
        _check_stall(now)


def last_delivery_age():
    """Seconds since the last delivery to a client, or None before the first."""
    last = _last_delivery_mono
    return None if last is None else round(time.monotonic() - last, 3)


def request_started():
    global _in_flight, _progress_mono
    with _count_lock:
        if _in_flight == 0:
            _progress_mono = time.monotonic()  # nothing was owed before
        _in_flight += 1


def request_finished(counted=True):
    """A request is done (completed, failed, or its client gone); a probe's
    (counted=False) is not counted in ``requests``."""
    global _in_flight, _requests
    with _count_lock:
        _in_flight = max(0, _in_flight - 1)
        if counted:
            _requests += 1


def cancelled():
    global _cancelled
    with _count_lock:
        _cancelled += 1


def counters():
    """A snapshot of the counters, for other parts (metrics, reports)."""
    data = record(phase())
    data["stalled"] = _stalled
    return data


# -- the keeper ------------------------------------------------------------------


def _start_keeper():
    global _keeper
    if _keeper is not None:
        return
    _keeper = threading.Thread(target=_keep, args=(_epoch, _keeper_wake), name="mlx-hotfix-heartbeat",
                               daemon=True)
    _keeper.start()


def _keep(epoch, wake):
    settings = config.current()
    tick = min(settings.heartbeat_interval, 1.0)
    while not _stopped and epoch == _epoch:
        wake.wait(tick)
        if _stopped or epoch != _epoch:
            return
        try:
            if _loading:
                _beat_file(LOADING)
                notifier = _systemd()
                if notifier is not None:
                    notifier.watchdog_ping()
            elif _loop_running and _check_stall(time.monotonic()):
                _beat_file(STALLED)  # the loop may be hung: say so from here
        except Exception:  # noqa: BLE001 - the keeper must outlive any surprise
            pass


def stop():
    """The loop is gone: no more beats, whatever still calls in."""
    global _stopped, _down
    _stopped = True
    _down = True


def serving_again():
    """After resume(): the fresh loop runs and requests are taken again, so
    /health may say so (the recover part calls this last)."""
    global _down
    _down = False


def died(summary, during_startup, cause=None):
    """The server is about to exit for a death: leave its one-line cause in the
    heartbeat file (the ``death`` field), where the watchdog reads it when the
    process is gone: a start-up failure (a bad --model, a taken port) is then
    named by its own cause, not by the exit code. ``cause`` is the death's
    class in the table of signatures (signatures.py; None: not classified).
    Never raises."""
    global _death
    try:
        if not config.current().heartbeat_file:
            return
        _death = {"summary": summary, "during_startup": bool(during_startup),
                  "time": time.time(), "cause": cause}
        _write(record(phase()))
    except Exception:  # noqa: BLE001 - the exit goes on whatever happens here
        pass


def undelivered_for(now):
    """Seconds that requests have been waiting with nothing delivered (0.0
    when none wait): the drain's no-progress rule reads it."""
    if _in_flight <= 0:
        return 0.0
    return max(0.0, now - _progress_mono)


def notify_status(text):
    notifier = _systemd()
    if notifier is not None:
        notifier.status(text)


def notify_stopping(text):
    notifier = _systemd()
    if notifier is not None:
        notifier.status(text)
        notifier.stopping()


def resume():
    """The recover part swaps a dead loop for a fresh one: beat again.

    Until the fresh loop's first pass (which sends READY=1 again), the
    recover part calls ``stand_in()`` so the heartbeat and systemd keep going.
    """
    global _generation_ident, _loop_running, _stopped, _stalled, _keeper, _epoch, _keeper_wake
    global _progress_mono, _beat_mono
    _epoch += 1  # the old keeper ends; the fresh loop starts its own
    _keeper = None
    _keeper_wake.set()
    _keeper_wake = threading.Event()
    _generation_ident = None  # the dead thread's late calls are not progress
    _loop_running = False
    _stalled = False
    _progress_mono = _beat_mono = time.monotonic()
    _stopped = False


def stand_in(text="recovering the generation loop"):
    """One beat while no loop runs: phase "loading", systemd fed."""
    _beat_file(LOADING)
    notifier = _systemd()
    if notifier is not None:
        notifier.status(text)
        notifier.watchdog_ping()
