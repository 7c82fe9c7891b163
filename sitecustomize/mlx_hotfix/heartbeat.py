"""The generation loop's heartbeat, for watchdogs.

The loop calls ``loop_iteration()`` on every pass, busy or idle (the exit
patch wires it in). That costs an integer increment and a clock read; at most
once per MLX_HOTFIX_HEARTBEAT_INTERVAL it also:

- rewrites MLX_HOTFIX_HEARTBEAT_FILE, when set, atomically, with one JSON
  line: {"pid", "beats", "time", "phase"} (phase: "loading" or "serving");
- pings systemd (WATCHDOG=1), when the service runs with NOTIFY_SOCKET and
  WatchdogSec=.

When the loop hangs, both stop: that is the signal. systemd also gets
READY=1 once the model is loaded and the loop runs.

A model load inside the loop (a client asking for another model) is one long
call with no iterations: ``model_load()`` marks it, and while it lasts a
keeper thread writes phase "loading" and keeps systemd fed, so a watchdog
applies its load limit instead of calling the loop stuck.
"""

import json
import os
import threading
import time

from . import config

_generation_ident = None
_loop_running = False
_stopped = False
_beats = 0
_next_write = 0.0
_notifier = None
_write_lock = threading.Lock()  # the loop and the load keeper share the temp file


def _systemd():
    global _notifier
    if _notifier is None:
        if os.environ.get("NOTIFY_SOCKET"):
            from .sdnotify import SdNotifier

            _notifier = SdNotifier.from_environ()
        else:
            _notifier = False
    return _notifier or None


def _write(phase):
    path = config.current().heartbeat_file
    if not path or _stopped:
        return
    if phase == "serving" and not listening():
        phase = "loading"  # a loop without a listener serves nobody
    record = {"pid": os.getpid(), "beats": _beats, "time": time.time(), "phase": phase}
    record.update(_identity())  # "rank", "host": which member of a group
    with _write_lock:
        try:
            write_atomically(path, json.dumps(record) + "\n")
        except OSError as exc:
            _warn_unwritable(path, exc)  # a full disk must not kill the loop


def write_atomically(path, text):
    """Replace path with text through a fresh temp file in its directory.

    mkstemp creates the temp file with O_EXCL and a random name, so a name
    planted by another user (a symlink to the owner's file) is never
    followed; os.replace then swaps the name itself, never a link's target.
    """
    import tempfile  # lazily: the drop-in imports only os and sys up front

    directory, name = os.path.split(os.path.abspath(path))
    descriptor, temporary = tempfile.mkstemp(prefix="." + name + ".", suffix=".tmp",
                                             dir=directory)
    try:
        try:
            os.fchmod(descriptor, 0o644)  # readable by a watchdog of another user
        except OSError:
            pass
        with os.fdopen(descriptor, "w") as handle:
            handle.write(text)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


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
    return _listener_bound or not _listener_hooked


def _announce_ready():
    notifier = _systemd()
    if notifier is not None:
        notifier.ready("serving")


_who = None


def _identity():
    global _who
    if _who is None:
        from .group import identity

        _who = identity()
    return _who


def generation_thread_started(generator):
    """Called at the top of ResponseGenerator._generate."""
    global _generation_ident
    if threading.current_thread() is not getattr(generator, "_generation_thread", None):
        return
    _generation_ident = threading.get_ident()
    _write("loading")
    notifier = _systemd()
    if notifier is not None:
        notifier.status("loading the model")


def loop_running():
    return _loop_running


class model_load:
    """Context manager around ModelProvider.load on the generation thread."""

    def __enter__(self):
        self._active = (
            _generation_ident is not None and threading.get_ident() == _generation_ident
            and not _stopped
        )
        if self._active:
            self._done = threading.Event()
            _write("loading")
            keeper = threading.Thread(target=self._keep, name="mlx-hotfix-load", daemon=True)
            keeper.start()
        return self

    def _keep(self):
        interval = config.current().heartbeat_interval
        while not self._done.wait(interval) and not _stopped:
            _write("loading")
            notifier = _systemd()
            if notifier is not None:
                notifier.watchdog_ping()

    def __exit__(self, *exc_info):
        if self._active:
            self._done.set()
            if _loop_running and not _stopped:
                _write("serving")
        return False


def loop_iteration():
    """One pass of the generation loop: cheap, called very often."""
    global _beats, _loop_running, _next_write
    if _stopped:
        return
    _beats += 1
    notifier = _notifier if _notifier is not None else _systemd()
    notifier = notifier or None
    if not _loop_running:
        _loop_running = True
        if notifier is not None and listening():
            notifier.ready("serving")
    if notifier is not None:
        notifier.watchdog_ping()  # rate-limited inside
    now = time.monotonic()
    if now >= _next_write:
        _next_write = now + config.current().heartbeat_interval
        _write("serving")


def beat_if_generation_thread():
    """A token or reply leaving the generation thread is progress too."""
    if _generation_ident is not None and threading.get_ident() == _generation_ident:
        loop_iteration()


def stop():
    """The loop is gone: no more beats, whatever still calls in."""
    global _stopped
    _stopped = True


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
    global _generation_ident, _loop_running, _stopped
    _generation_ident = None  # the dead thread's late calls are not progress
    _loop_running = False
    _stopped = False


def stand_in(text="recovering the generation loop"):
    """One beat while no loop runs: phase "loading", systemd fed."""
    _write("loading")
    notifier = _systemd()
    if notifier is not None:
        notifier.status(text)
        notifier.watchdog_ping()
