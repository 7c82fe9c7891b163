"""Crash reports: one JSON file per event, for the user and for upstream.

    write_report(kind, *, exc=None, extra=None) -> path or None

Kinds: "died" (the generation thread's death, from the exit part), "wedged"
or "aborted" (a fatal-stack file of an earlier process, folded in at the next
start), and later kinds such as "recovered" fit the same shape. Files go to
MLX_HOTFIX_REPORT_DIR (default ~/Library/Logs/mlx-watchdog/reports on macOS,
${XDG_STATE_HOME:-~/.local/state}/mlx-watchdog/reports elsewhere), mode 0600,
written whole (mkstemp + os.replace); the newest KEEP are kept.

Never in a report: prompt or completion text, API keys. A request is
described by its shape only (prompt token count, max_tokens, stream,
sampling fields).

Stacks on demand: prepare() registers faulthandler for SIGUSR1 (all threads)
into ``stacks-<pid>.txt`` in the report dir, which works even when the hung
thread holds the GIL in native code, and faulthandler.enable() into
``fatal-<pid>.txt``, so systemd's WatchdogSignal=SIGABRT leaves the stacks
there too. The watchdog sends SIGUSR1 only to a pid whose stacks file
exists (without the handler, SIGUSR1 would kill the process).

write_report never raises: a report is evidence, never a new way to fail.
"""

import json
import os
import sys
import threading
import time

from ._files import write_atomically

KEEP = 50
SCHEMA = 1
_STACKS_PREFIX = "stacks-"
_FATAL_PREFIX = "fatal-"
_SECRET_WORDS = ("key", "token", "secret", "password", "passwd", "auth")
_SAMPLING_FIELDS = (
    "max_tokens", "stream", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "repetition_context_size", "presence_penalty", "frequency_penalty", "xtc_probability",
    "xtc_threshold", "logprobs", "top_logprobs", "seed", "num_draft_tokens",
)

_started = time.time()
_files = []  # keep the faulthandler files open for the life of the process


def report_dir():
    configured = os.environ.get("MLX_HOTFIX_REPORT_DIR", "").strip()
    if configured:
        return os.path.expanduser(configured)
    if sys.platform == "darwin":
        return os.path.expanduser("~/Library/Logs/mlx-watchdog/reports")
    state = os.environ.get("XDG_STATE_HOME", "").strip() or os.path.expanduser("~/.local/state")
    return os.path.join(state, "mlx-watchdog", "reports")


def _ensure_dir(path):
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


# -- the pieces of a report -----------------------------------------------


def _versions():
    import platform

    from . import patches

    return {
        "mlx_lm": patches.mlx_lm_version(),
        "mlx": patches.mlx_version(),
        "python": platform.python_version(),
        "os": platform.platform(),
    }


def _status_line():
    from . import patches

    return patches.status_line()


def _format_stacks():
    import traceback

    names = {t.ident: t.name for t in threading.enumerate()}
    stacks = []
    for ident, frame in sys._current_frames().items():
        stacks.append({
            "thread": names.get(ident, "unknown"),
            "ident": ident,
            "stack": "".join(traceback.format_stack(frame)),
        })
    return stacks


def redact_argv(argv):
    """Values of flags that look secret become '***' (--api-key K, --token=K)."""
    out = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append("***")
            hide_next = False
            continue
        flag, eq, _value = arg.partition("=")
        secret = flag.startswith("-") and any(w in flag.lower() for w in _SECRET_WORDS)
        if secret and eq:
            out.append(flag + "=***")
        else:
            out.append(arg)
            hide_next = secret
    return out


def request_shape(handler, frames=None):
    """What a request asked for, never what it said."""
    shape = {}
    for name in _SAMPLING_FIELDS:
        value = getattr(handler, name, None)
        if isinstance(value, (int, float, bool, str)) or value is None:
            if value is not None:
                shape[name] = value
    shape["path"] = getattr(handler, "path", None)
    body = getattr(handler, "body", None)
    if isinstance(body, dict):
        messages = body.get("messages")
        if isinstance(messages, list):
            shape["messages"] = len(messages)
    # The prompt's token count: the ctx local of the handler's own frame.
    for frame in frames or ():
        while frame is not None:
            if frame.f_locals.get("self") is handler:
                ctx = frame.f_locals.get("ctx")
                prompt = getattr(ctx, "prompt", None)
                if prompt is not None:
                    try:
                        shape["prompt_tokens"] = len(prompt)
                    except TypeError:
                        pass
            frame = frame.f_back
    shape.setdefault("prompt_tokens", None)
    return shape


def capture_in_flight(handlers):
    """The shapes of the requests in flight (handlers: the live connections)."""
    try:
        frames = list(sys._current_frames().values())
        return [request_shape(h, frames) for h in list(handlers)
                if getattr(h, "body", None) is not None or hasattr(h, "max_tokens")]
    except Exception:  # noqa: BLE001
        return None


def _heartbeat():
    from . import heartbeat

    counters = dict(heartbeat.counters())
    try:
        from . import config

        path = config.current().heartbeat_file
        if path:
            with open(path) as handle:
                counters["file"] = json.loads(handle.read(8192))
    except Exception:  # noqa: BLE001
        pass
    return counters


def _memory():
    memory = {}
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        memory["peak_rss_bytes"] = peak if sys.platform == "darwin" else peak * 1024
    except Exception:  # noqa: BLE001
        pass
    try:
        with open("/proc/self/statm") as handle:
            memory["rss_bytes"] = int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except Exception:  # noqa: BLE001
        pass
    core = sys.modules.get("mlx.core")
    if core is not None:
        for key, name in (("mlx_active_bytes", "get_active_memory"),
                          ("mlx_peak_bytes", "get_peak_memory"),
                          ("mlx_cache_bytes", "get_cache_memory")):
            function = getattr(core, name, None) or getattr(
                getattr(core, "metal", None), name, None)
            if callable(function):
                try:
                    memory[key] = int(function())
                except Exception:  # noqa: BLE001
                    pass
    return memory


def _flag(argv, name):
    """The last value of --name in argv (``--name V`` or ``--name=V``), or None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def instance():
    """Which server this is, so that reports of several instances sharing a
    folder can be told apart: MLX_HOTFIX_INSTANCE (set by supervise and
    install: the watchdog's instance name), and the --port and --model of
    the server's command line."""
    argv = list(sys.argv)
    port = _flag(argv, "--port")
    return {
        "name": os.environ.get("MLX_HOTFIX_INSTANCE", "").strip() or None,
        "port": int(port) if port and port.isdigit() else None,
        "model": _flag(argv, "--model"),
    }


def _exception(exc):
    if exc is None:
        return None
    import traceback

    return {
        "type": "%s.%s" % (type(exc).__module__, type(exc).__qualname__),
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    }


def _gather(name, function, report):
    try:
        report[name] = function()
    except Exception as error:  # noqa: BLE001
        report[name] = None
        report.setdefault("errors", []).append("%s: %s: %s" % (name, type(error).__name__, error))


def build_report(kind, exc=None, extra=None):
    now = time.time()
    report = {"schema": SCHEMA, "kind": str(kind), "time": now, "pid": os.getpid(),
              "uptime_s": round(now - _started, 3), "source": "shim"}
    _gather("versions", _versions, report)
    _gather("status", _status_line, report)
    _gather("exception", lambda: _exception(exc), report)
    _gather("stacks", _format_stacks, report)
    _gather("argv", lambda: redact_argv(sys.argv), report)
    _gather("heartbeat", _heartbeat, report)
    _gather("memory", _memory, report)
    _gather("instance", instance, report)
    report.setdefault("in_flight", None)
    report.setdefault("exit_code", None)
    for key, value in (extra or {}).items():
        report[key] = value
    return report


# -- writing -----------------------------------------------------------------


def write_json(directory, name, data):
    """Write data as name in directory, whole or not at all, mode 0600."""
    _ensure_dir(directory)
    path = os.path.join(directory, name)
    write_atomically(path, json.dumps(data, indent=1, sort_keys=True, default=repr) + "\n")
    return path


def report_name(kind, pid, when):
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(when))
    return "%s-%03d-%s-%d.json" % (stamp, int((when % 1) * 1000), kind, pid)


def prune(directory, keep=KEEP):
    """Keep the newest `keep` reports (by name: they start with their time)."""
    names = sorted(n for n in os.listdir(directory)
                   if n.endswith(".json") and not n.startswith("."))
    for name in names[:-keep] if keep else names:
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            pass


def write_report(kind, *, exc=None, extra=None):
    """Write one report; its path, or None if it could not be written. Never raises.

    A start-up death identical to the newest report's (same instance, same
    exception) adds to that report's ``repeats`` instead: a server that cannot
    start (a bad --model, a taken port) and is restarted forever must not
    evict the reports that matter."""
    try:
        report = build_report(kind, exc, extra)
        directory = report_dir()
        repeated = _count_repeat(directory, report)
        if repeated is not None:
            return repeated
        path = write_json(directory, report_name(kind, report["pid"], report["time"]), report)
        prune(directory)
        return path
    except BaseException as error:  # noqa: BLE001 - evidence must never kill anything
        try:
            from . import log

            log.say("could not write a %s report: %s: %s" % (kind, type(error).__name__, error))
        except BaseException:  # noqa: BLE001
            pass
        return None


def _same_startup_death(old, new):
    def key(report):
        exc = report.get("exception") or {}
        return (report.get("kind"), bool(report.get("during_startup")), report.get("instance"),
                exc.get("type"), exc.get("message"))

    return new.get("during_startup") and isinstance(old, dict) and key(old) == key(new)


def _count_repeat(directory, report):
    """The newest report's path after counting report as a repeat of it, or
    None when report is not the same start-up death."""
    if not report.get("during_startup"):
        return None
    try:
        names = sorted(n for n in os.listdir(directory)
                       if n.endswith(".json") and not n.startswith("."))
    except OSError:
        return None
    if not names:
        return None
    path = os.path.join(directory, names[-1])
    try:
        with open(path) as handle:
            newest = json.loads(handle.read(1 << 22))
    except (OSError, ValueError):
        return None
    if not _same_startup_death(newest, report):
        return None
    newest["repeats"] = int(newest.get("repeats") or 1) + 1
    newest["last_time"] = report["time"]
    newest["last_pid"] = report["pid"]
    write_json(directory, names[-1], newest)
    return path


# -- stacks on demand, fatal stacks ------------------------------------------


def stacks_path(pid=None, directory=None):
    return os.path.join(directory or report_dir(), "%s%d.txt" % (_STACKS_PREFIX, pid or os.getpid()))


def fatal_path(pid=None, directory=None):
    return os.path.join(directory or report_dir(), "%s%d.txt" % (_FATAL_PREFIX, pid or os.getpid()))


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def fold_fatal_files(directory=None):
    """Turn non-empty fatal-stack files of dead processes into reports."""
    directory = directory or report_dir()
    written = []
    for name in os.listdir(directory):
        for prefix in (_FATAL_PREFIX, _STACKS_PREFIX):
            if not (name.startswith(prefix) and name.endswith(".txt")):
                continue
            try:
                pid = int(name[len(prefix):-4])
            except ValueError:
                continue
            if pid == os.getpid() or _pid_alive(pid):
                continue
            path = os.path.join(directory, name)
            try:
                with open(path, errors="replace") as handle:
                    text = handle.read(1 << 20)
                mtime = os.path.getmtime(path)
                if prefix == _FATAL_PREFIX and text.strip():
                    kind = "aborted" if "Aborted" in text else "wedged"
                    report = {
                        "schema": SCHEMA, "kind": kind, "time": mtime, "pid": pid,
                        "source": "fatal-stack file, folded in by pid %d" % os.getpid(),
                        "fatal_stacks": text, "in_flight": None, "exit_code": None,
                        "reason": "the process received a fatal signal (SIGABRT from "
                                  "systemd's WatchdogSignal, or a crash)",
                    }
                    written.append(write_json(directory, report_name(kind, pid, mtime), report))
                    from . import log

                    log.say("pid %d left fatal stacks; folded into %s" % (pid, written[-1]))
                    # The journal (or the service log) gets them too: the
                    # dying process wrote them to this file, not to stderr.
                    sys.stderr.write(text if text.endswith("\n") else text + "\n")
                    sys.stderr.flush()
                os.unlink(path)
            except OSError:
                pass
    if written:
        prune(directory)
    return written


def prepare():
    """At activation: fold what earlier processes left, then arm faulthandler.

    Never raises; the server starts whatever happens here.
    """
    try:
        import faulthandler
        import signal

        directory = _ensure_dir(report_dir())
        try:
            fold_fatal_files(directory)
        except OSError:
            pass
        fatal = open(fatal_path(directory=directory), "w")
        os.chmod(fatal.name, 0o600)
        _files.append(fatal)
        # Into the file even under PYTHONFAULTHANDLER=1 (stderr, the journal):
        # the next start folds it into a report and names it on stderr.
        faulthandler.enable(file=fatal, all_threads=True)
        sigusr1 = getattr(signal, "SIGUSR1", None)
        if sigusr1 is not None:
            stacks = open(stacks_path(directory=directory), "w")
            os.chmod(stacks.name, 0o600)
            _files.append(stacks)
            faulthandler.register(sigusr1, file=stacks, all_threads=True, chain=False)
        import atexit

        atexit.register(_cleanup, directory)
    except Exception as error:  # noqa: BLE001
        try:
            from . import log

            log.say("stacks on demand are off: %s: %s" % (type(error).__name__, error))
        except Exception:  # noqa: BLE001
            pass


def _cleanup(directory):
    """A clean exit leaves no stack files behind (os._exit skips this; the
    next start folds or removes them)."""
    try:
        os.unlink(stacks_path(directory=directory))
        if os.path.getsize(fatal_path(directory=directory)) == 0:
            os.unlink(fatal_path(directory=directory))
    except OSError:
        pass


def count_reports(directory=None):
    """How many reports the directory holds (for metrics)."""
    try:
        return sum(1 for n in os.listdir(directory or report_dir())
                   if n.endswith(".json") and not n.startswith("."))
    except OSError:
        return 0
