"""Crash reports: one JSON file per event, for the user and for upstream.

    write_report(kind, *, exc=None, extra=None) -> path or None

Kinds: "died" (the generation thread's death, from the exit part), "wedged"
or "aborted" (a fatal-stack file of an earlier process, folded in at the next
start), and later kinds such as "recovered" fit the same shape. Files go to
MLX_HOTFIX_REPORT_DIR (default ~/Library/Logs/mlx-watchdog/reports on macOS,
${XDG_STATE_HOME:-~/.local/state}/mlx-watchdog/reports elsewhere), mode 0600,
written whole (mkstemp + os.replace); the newest KEEP are kept. Pruning
touches only report names (``REPORT_NAME``: ``<date>-<time>-<ms>-<kind>-<pid>.json``,
as the shim and the watchdog write them), never the report just written.

Never in a report: prompt or completion text, API keys. A request is
described by its shape only (prompt token count, max_tokens, stream,
sampling fields).

Stacks on demand: prepare(), called once when the process turns out to be a
server (mlx_lm.server imported or run as __main__; never on a plain
``import mlx_lm``), registers faulthandler for SIGUSR1 (all threads)
into ``stacks-<pid>.txt`` in the report dir, which works even when the hung
thread holds the GIL in native code, and faulthandler.enable() into
``fatal-<pid>.txt``, so systemd's WatchdogSignal=SIGABRT leaves the stacks
there too. Both are created under a random name and renamed into place
(_files.create_private), so a symlink planted under either name is
replaced, never followed; folding reads only regular files (O_NOFOLLOW).
The watchdog sends SIGUSR1 only to a pid whose stacks file exists (without
the handler, SIGUSR1 would kill the process).

write_report never raises: a report is evidence, never a new way to fail.
"""

import json
import os
import re
import sys
import threading
import time

from . import contract
from ._files import create_private, read_regular, write_atomically

# The folder, the names, KEEP, SCHEMA, pruning and argv redaction are the
# contract with the watchdog (contract.py), which reads what is written here.
from .contract import (KEEP, SCHEMA, prune, redact_argv, report_dir,  # noqa: F401
                       report_name, report_names)

_SAMPLING_FIELDS = (
    "max_tokens", "stream", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "repetition_context_size", "presence_penalty", "frequency_penalty", "xtc_probability",
    "xtc_threshold", "logprobs", "top_logprobs", "seed", "num_draft_tokens",
)

_started = time.time()
_files = []  # keep the faulthandler files open for the life of the process


def _ensure_dir(path):
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


# -- the pieces of a report -----------------------------------------------


def _versions():
    import platform

    from .versions import mlx_lm_version, mlx_version

    return {
        "mlx_lm": mlx_lm_version(),
        "mlx": mlx_version(),
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

        settings = config.current()
        if settings.heartbeat_file:
            record = json.loads(read_regular(settings.heartbeat_file, 8192))
            death = record.get("death") if isinstance(record, dict) else None
            # The death's summary is the exception's text: redacted as the
            # report's own message is (_exception).
            if (isinstance(death, dict) and isinstance(death.get("summary"), str)
                    and not settings.report_messages):
                death["summary"] = redact_message(death["summary"])
            counters["file"] = record
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
        "name": os.environ.get(contract.INSTANCE_ENV, "").strip() or None,
        "port": int(port) if port and port.isdigit() else None,
        "model": _flag(argv, "--model"),
    }


# What in an exception's text looks like request content (docs/operator.md, "Crash reports").
_QUOTED = re.compile(r"'(?:[^'\\\n]|\\.)*'" + r'|"(?:[^"\\\n]|\\.)*"')
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,40}\Z")  # 'list', 'NoneType', 'role': code
_NUMBERS = re.compile(r"-?[0-9]+(?:\s*,\s*-?[0-9]+){7,}")  # token ids
_LONG_RUN = re.compile(r"\S{41,}")
_MESSAGE_LIMIT = 1000


def redact_message(text):
    """text with what looks like request content replaced by '<redacted N chars>':
    quoted strings (but a single identifier-like word), lists of 8 or more
    numbers (token ids), unbroken runs of more than 40 characters; then cut to
    1000 characters."""
    def quoted(match):
        body = match.group(0)[1:-1]
        if _WORD.match(body):
            return match.group(0)
        return "%s<redacted %d chars>%s" % (match.group(0)[0], len(body), match.group(0)[0])

    text = _QUOTED.sub(quoted, text)
    text = _NUMBERS.sub(lambda m: "<redacted %d numbers>" % (m.group(0).count(",") + 1), text)
    text = _LONG_RUN.sub(lambda m: "<redacted %d chars>" % len(m.group(0)), text)
    if len(text) > _MESSAGE_LIMIT:
        text = text[:_MESSAGE_LIMIT] + "<cut: %d chars in all>" % len(text)
    return text


def _type_name(exc):
    return "%s.%s" % (type(exc).__module__, type(exc).__qualname__)


def _format_chain(exc, message_of):
    """The traceback as Python prints it (the chain of causes, every frame),
    each exception's text given by message_of(exc)."""
    import traceback

    blocks, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        lines = ["Traceback (most recent call last):\n"] if exc.__traceback__ else []
        lines += traceback.format_tb(exc.__traceback__)
        lines.append("%s: %s\n" % (_type_name(exc), message_of(exc)))
        blocks.append("".join(lines))
        if exc.__cause__ is not None:
            blocks.append("\nThe above exception was the direct cause of the following "
                          "exception:\n\n")
            exc = exc.__cause__
        elif exc.__context__ is not None and not exc.__suppress_context__:
            blocks.append("\nDuring handling of the above exception, another exception "
                          "occurred:\n\n")
            exc = exc.__context__
        else:
            exc = None
    return "".join(reversed(blocks))


def _exception(exc):
    """The exception for a report: its type and every frame always; its text
    redacted (redact_message) unless MLX_HOTFIX_REPORT_MESSAGES=1."""
    if exc is None:
        return None
    from . import config

    whole = config.current().report_messages
    message_of = str if whole else (lambda e: redact_message(str(e)))
    return {
        "type": _type_name(exc),
        "message": message_of(exc),
        "message_redacted": not whole,
        "traceback": _format_chain(exc, message_of),
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
        name = report_name(kind, report["pid"], report["time"])
        path = write_json(directory, name, report)
        prune(directory, written=name)
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
    names = report_names(directory)
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
    return os.path.join(directory or report_dir(), contract.stacks_name(pid or os.getpid()))


def fatal_path(pid=None, directory=None):
    return os.path.join(directory or report_dir(), contract.fatal_name(pid or os.getpid()))


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def fold_fatal_files(directory=None, *, before_arming=False):
    """Turn non-empty fatal-stack files of dead processes into reports.

    before_arming: this process has no files of its own yet, so one named
    with its pid was left by an earlier process that had the same pid.
    """
    directory = directory or report_dir()
    written = []
    for name in os.listdir(directory):
        for prefix in (contract.FATAL_PREFIX, contract.STACKS_PREFIX):
            if not (name.startswith(prefix) and name.endswith(".txt")):
                continue
            digits = name[len(prefix):-4]
            if not (digits.isascii() and digits.isdigit()):
                continue
            pid = int(digits)
            if pid == os.getpid() and not before_arming:
                continue
            if pid != os.getpid() and _pid_alive(pid):
                continue
            path = os.path.join(directory, name)
            try:
                text = read_regular(path, 1 << 20)
                mtime = os.lstat(path).st_mtime
                if prefix == contract.FATAL_PREFIX and text.strip():
                    kind = "aborted" if "Aborted" in text else "wedged"
                    report = {
                        "schema": SCHEMA, "kind": kind, "time": mtime, "pid": pid,
                        "source": "fatal-stack file, folded in by pid %d" % os.getpid(),
                        "fatal_stacks": text, "in_flight": None, "exit_code": None,
                        "reason": "the process received a fatal signal (SIGABRT from "
                                  "systemd's WatchdogSignal, or a crash)",
                    }
                    written.append(report_name(kind, pid, mtime))
                    write_json(directory, written[-1], report)
                    from . import log

                    log.say("pid %d left fatal stacks; folded into %s"
                            % (pid, os.path.join(directory, written[-1])))
                    # The journal (or the service log) gets them too: the
                    # dying process wrote them to this file, not to stderr.
                    sys.stderr.write(text if text.endswith("\n") else text + "\n")
                    sys.stderr.flush()
                os.unlink(path)
            except OSError:
                pass
    if written:
        prune(directory, written=written[-1])
    return [os.path.join(directory, name) for name in written]


_prepared = False


def prepare():
    """When a server starts: fold what earlier processes left, then arm faulthandler.

    Once per process. Never raises; the server starts whatever happens here.
    """
    global _prepared
    if _prepared:
        return
    _prepared = True
    try:
        import faulthandler
        import signal

        directory = _ensure_dir(report_dir())
        try:
            fold_fatal_files(directory, before_arming=True)
        except OSError:
            pass
        fatal = create_private(fatal_path(directory=directory))
        _files.append(fatal)
        # Into the file even under PYTHONFAULTHANDLER=1 (stderr, the journal):
        # the next start folds it into a report and names it on stderr.
        faulthandler.enable(file=fatal, all_threads=True)
        sigusr1 = getattr(signal, "SIGUSR1", None)
        if sigusr1 is not None:
            stacks = create_private(stacks_path(directory=directory))
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
