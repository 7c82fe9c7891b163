"""The shim's settings, read once from the environment.

MLX_HOTFIX=0                 the whole shim off (handled in sitecustomize.py)
MLX_HOTFIX_DISABLE=a,b       turn off the named parts (PARTS below)
MLX_HOTFIX_DEBUG=1           verbose
MLX_HOTFIX_EXIT_CODE=70      exit status after the generation thread dies
MLX_HOTFIX_EXIT_GRACE=2.0    at most this many seconds to answer waiting clients
                             (the exit goes as soon as all are answered; values
                             below MIN_EXIT_GRACE are raised to it, so that 0
                             never cuts a client off)
MLX_HOTFIX_HEARTBEAT_FILE=P  write a heartbeat file from the generation loop
MLX_HOTFIX_HEARTBEAT_INTERVAL=1.0  at most one heartbeat write per this many s
MLX_HOTFIX_INSTANCE=NAME     the watchdog's name for this server, in crash reports
MLX_HOTFIX_PARENT_PID=N      exit when process N (the supervisor) is gone
MLX_HOTFIX_RECOVER=exit      on a death: exit (default), or thread: a fresh loop in place
MLX_HOTFIX_RECOVER_LIMIT=3   at most this many in-place recoveries ...
MLX_HOTFIX_RECOVER_WINDOW=600  ... in this many seconds; past that, exit
MLX_HOTFIX_STALL_TIMEOUT=300 requests in flight and nothing delivered this long: stalled
MLX_HOTFIX_MAX_QUEUE=N       at most N requests wait for a slot; more get 503 (default: no limit)
MLX_HOTFIX_QUEUE_TIMEOUT=S   a request waiting for a slot this long gets 503 (default: none)
MLX_HOTFIX_REQUEST_TIMEOUT=S a request still generating this long after it came is cut
                             short, finish_reason "length" (default: none)
MLX_HOTFIX_DRAIN_TIMEOUT=25  the first SIGTERM drains at most this long (0: answer at once)
MLX_HOTFIX_DRAIN_QUIET=3     a drain on a port of the server's own keeps answering 503 until no
                             new request came for this long (a balancer's time to take it out)
MLX_HOTFIX_LAUNCHD_SOCKET=N  serve on launchd's socket N of the job's Sockets (macOS)
MLX_HOTFIX_REPORT_MESSAGES=1  crash reports keep exception messages whole (by default
                             anything that looks like request content is redacted)

Numbers are plain decimal: an integer is digits with an optional sign
("70", not "7_0" or "0x46"), a number of seconds may have a fraction and an
exponent ("2.5", "1e3"); anything else is named on stderr and the default used.
"""

import os
import re

from . import contract

PARTS = ("exit", "heartbeat", "extend", "advance", "recover", "disconnect", "prompt_cache_bytes",
         "extract", "validate", "admission", "drain", "socket")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
# int() and float() also take "1_0" (as 10), "٧٠" (Arabic-Indic digits), and
# float() "nan" and "inf": a setting is read only when written the plain way.
_PLAIN = {
    int: re.compile(r"[+-]?[0-9]+\Z"),
    float: re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\Z"),
}


def plain_number(raw, kind):
    """raw read as kind (int or float) if written as a plain decimal, else None."""
    if not _PLAIN[kind].match(raw):
        return None
    return kind(raw)


_current = None
MIN_EXIT_GRACE = 2.0  # room for every waiting client to be answered, under load too
# Below the 30 s that launchd's ExitTimeOut, systemd's TimeoutStopSec and the
# watchdog's stop grace give a stopping server before SIGKILL.
DEFAULT_DRAIN_TIMEOUT = 25.0
# The shipped HAProxy config marks a server down within inter + (fall - 1) *
# fastinter = 2 + 1 s of its first 503 "draining" (monitoring/haproxy.cfg).
DEFAULT_DRAIN_QUIET = 3.0


class Config:
    def __init__(self, environ):
        self.warnings = []
        self.debug = environ.get("MLX_HOTFIX_DEBUG", "").strip().lower() in _TRUE
        self.report_messages = self._flag(environ, "MLX_HOTFIX_REPORT_MESSAGES")
        self.disabled = self._parse_disable(environ.get(contract.DISABLE_ENV, ""))
        self.exit_code = self._number(
            environ, "MLX_HOTFIX_EXIT_CODE", contract.EXIT_CODE, int, lambda v: 1 <= v <= 255,
            "an integer from 1 to 255",
        )
        self.exit_grace = self._number(
            environ, "MLX_HOTFIX_EXIT_GRACE", MIN_EXIT_GRACE, float, lambda v: 0 <= v <= 60,
            "a number of seconds from 0 to 60",
        )
        # In a distributed group rank N>0 writes <file>.rankN (see group.py).
        from .group import heartbeat_path

        self.heartbeat_file = heartbeat_path(environ.get(contract.HEARTBEAT_FILE_ENV) or None,
                                             environ)
        self.heartbeat_interval = self._number(
            environ, "MLX_HOTFIX_HEARTBEAT_INTERVAL", 1.0, float,
            lambda v: 0.05 <= v <= 3600, "a number of seconds from 0.05 to 3600",
        )
        self.recover_mode = self._choice(environ, "MLX_HOTFIX_RECOVER", "exit", ("exit", "thread"))
        self.recover_limit = self._number(
            environ, "MLX_HOTFIX_RECOVER_LIMIT", 3, int, lambda v: 1 <= v <= 1000,
            "an integer from 1 to 1000",
        )
        self.recover_window = self._number(
            environ, "MLX_HOTFIX_RECOVER_WINDOW", 600.0, float, lambda v: 0 < v <= 86400,
            "a number of seconds from 0 to 86400",
        )
        # Longer than the longest single prefill step (see docs/operator.md, "Liveness").
        self.stall_timeout = self._number(
            environ, contract.STALL_TIMEOUT_ENV, 300.0, float,
            lambda v: 1 <= v <= 86400, "a number of seconds from 1 to 86400",
        )
        self.drain_timeout = self._number(
            environ, contract.DRAIN_TIMEOUT_ENV, DEFAULT_DRAIN_TIMEOUT, float,
            lambda v: 0 <= v <= 3600, "a number of seconds from 0 to 3600",
        )
        self.drain_quiet = self._number(
            environ, "MLX_HOTFIX_DRAIN_QUIET", DEFAULT_DRAIN_QUIET, float,
            lambda v: 0 <= v <= 3600, "a number of seconds from 0 to 3600",
        )
        self.launchd_socket = environ.get(contract.LAUNCHD_SOCKET_ENV, "").strip() or None
        self.parent_pid = self._number(
            environ, contract.PARENT_PID_ENV, None, int, lambda v: v > 1, "a process id"
        )
        # Admission (patches/admission.py): unset is no limit, as stock.
        self.max_queue = self._number(
            environ, "MLX_HOTFIX_MAX_QUEUE", None, int, lambda v: 1 <= v <= 1000000,
            "a whole number of requests from 1 to 1000000", shown="no limit",
        )
        self.queue_timeout = self._seconds(environ, "MLX_HOTFIX_QUEUE_TIMEOUT")
        self.request_timeout = self._seconds(environ, "MLX_HOTFIX_REQUEST_TIMEOUT")
        if self.exit_grace < MIN_EXIT_GRACE:
            self.warnings.append(
                "MLX_HOTFIX_EXIT_GRACE=%g is below the %g s needed to answer every waiting "
                "client; using %g (the exit still goes as soon as all are answered)"
                % (self.exit_grace, MIN_EXIT_GRACE, MIN_EXIT_GRACE)
            )
            self.exit_grace = MIN_EXIT_GRACE

    def _flag(self, environ, key):
        raw = environ.get(key, "").strip().lower()
        if raw in _TRUE:
            return True
        if raw not in _FALSE:
            self.warnings.append("%s=%r is not 0/1; using 0" % (key, raw))
        return False

    def _choice(self, environ, key, default, choices):
        raw = environ.get(key, "").strip().lower()
        if not raw:
            return default
        if raw in choices:
            return raw
        self.warnings.append(
            "%s=%r is not one of %s; using %r" % (key, raw, ", ".join(choices), default)
        )
        return default

    def _parse_disable(self, raw):
        names = [n.strip().lower() for n in raw.split(",") if n.strip()]
        unknown = [n for n in names if n not in PARTS]
        if unknown:
            self.warnings.append(
                "MLX_HOTFIX_DISABLE: unknown name%s %s ignored; known names: %s"
                % ("s" if len(unknown) > 1 else "", ", ".join(map(repr, unknown)),
                   ", ".join(PARTS))
            )
        return frozenset(n for n in names if n in PARTS)

    def _number(self, environ, key, default, kind, valid, expected, shown=None):
        raw = environ.get(key, "").strip()
        if not raw:
            return default
        value = plain_number(raw, kind)
        if value is not None and valid(value):
            return value
        self.warnings.append(
            "%s=%r is not %s; using %s" % (key, raw, expected,
                                          shown if shown is not None else repr(default))
        )
        return default

    def _seconds(self, environ, key):
        """An optional limit in seconds: unset (None) is no limit."""
        return self._number(
            environ, key, None, float, lambda v: 0 < v <= 86400 * 365,
            "a number of seconds above 0", shown="no limit",
        )

    def enabled(self, part):
        return part not in self.disabled


def current():
    global _current
    if _current is None:
        _current = Config(os.environ)
    return _current
