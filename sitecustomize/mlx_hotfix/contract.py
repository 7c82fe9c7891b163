"""What the shim and the watchdog agree on, in one place.

The shim writes files (the heartbeat record, crash reports, stacks and
fatal-stack files) and reads settings from its environment; the watchdog
reads those files and sets those settings. Every name both sides use lives
here: the shim imports this module, the watchdog loads it by path as data
(mlx_watchdog/contract.py; it never imports mlx_hotfix as a package), and
monitoring/alerts.yml is tested against the restart causes below
(tests/test_contract.py).

Stdlib only (os, re, sys, time), imported lazily by the shim: nothing here runs
before mlx_lm is imported.
"""

import os
import re
import sys
import time

# -- environment: what the watchdog (supervise, watch, install) sets or reads --

DISABLE_ENV = "MLX_HOTFIX_DISABLE"
HEARTBEAT_FILE_ENV = "MLX_HOTFIX_HEARTBEAT_FILE"
REPORT_DIR_ENV = "MLX_HOTFIX_REPORT_DIR"
INSTANCE_ENV = "MLX_HOTFIX_INSTANCE"  # the watchdog's name for the server, in its reports
PARENT_PID_ENV = "MLX_HOTFIX_PARENT_PID"  # the shim exits when this process is gone
DRAIN_TIMEOUT_ENV = "MLX_HOTFIX_DRAIN_TIMEOUT"
STALL_TIMEOUT_ENV = "MLX_HOTFIX_STALL_TIMEOUT"
LAUNCHD_SOCKET_ENV = "MLX_HOTFIX_LAUNCHD_SOCKET"
ENV_PREFIX = "MLX_HOTFIX_"

EXIT_CODE = 70  # the shim's exit status after the generation thread dies (MLX_HOTFIX_EXIT_CODE)

# -- the heartbeat record (MLX_HOTFIX_HEARTBEAT_FILE) --------------------------
# Fields only grow. pid, beats, time and phase are in every record an old shim
# wrote; every other field is optional to a reader.

LOADING, SERVING, STALLED = "loading", "serving", "stalled"
PHASES = (LOADING, SERVING, STALLED)
HEARTBEAT_REQUIRED = ("pid", "beats", "time", "phase")
HEARTBEAT_FIELDS = HEARTBEAT_REQUIRED + (
    "started", "in_flight", "delivered", "last_delivery", "prompt_tokens", "decode_tokens",
    "requests", "cancelled", "rank", "host", "memory",
    "warning",  # only with a known-bad install
    "death",  # only after the generation thread died
    # the admission part's (patches/admission.py), when it is on
    "queued", "running", "rejected_queue_full", "rejected_queue_timeout", "deadline_stops",
)


def rank_file(base, rank):
    """Rank 0 (and a lone server) writes base itself; rank N>0 writes
    ``<base>.rankN`` next to it, so that every local rank has its own file."""
    return base if not rank else "%s.rank%d" % (base, rank)


RANK_FILE = re.compile(r"\.rank([0-9]+)\Z")  # the suffix rank_file adds

# -- the report folder ---------------------------------------------------------

KEEP = 50  # the newest this many reports are kept
SCHEMA = 1  # a report's "schema" field
REPORT_NAME = re.compile(r"[0-9]{8}-[0-9]{6}-[0-9]{3}-[a-z][a-z_]*-[0-9]+\.json\Z")
STACKS_PREFIX = "stacks-"  # stacks-<pid>.txt: SIGUSR1 dumps every thread's stack here
FATAL_PREFIX = "fatal-"  # fatal-<pid>.txt: faulthandler's output on a fatal signal


def report_dir(environ=None):
    """Where reports live: $MLX_HOTFIX_REPORT_DIR, else
    ~/Library/Logs/mlx-watchdog/reports on macOS,
    ${XDG_STATE_HOME:-~/.local/state}/mlx-watchdog/reports elsewhere."""
    environ = os.environ if environ is None else environ
    configured = environ.get(REPORT_DIR_ENV, "").strip()
    if configured:
        return os.path.expanduser(configured)
    if sys.platform == "darwin":
        return os.path.expanduser("~/Library/Logs/mlx-watchdog/reports")
    state = environ.get("XDG_STATE_HOME", "").strip() or os.path.expanduser("~/.local/state")
    return os.path.join(state, "mlx-watchdog", "reports")


def report_name(kind, pid, when):
    """<date>-<time>-<ms>-<kind>-<pid>.json (matches REPORT_NAME; sorts by time)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(when))
    return "%s-%03d-%s-%d.json" % (stamp, int((when % 1) * 1000), kind, pid)


def stacks_name(pid):
    return "%s%d.txt" % (STACKS_PREFIX, pid)


def fatal_name(pid):
    return "%s%d.txt" % (FATAL_PREFIX, pid)


def report_names(directory):
    """The report names in directory, oldest first; only REPORT_NAME names
    (anything else in the folder is not ours). [] when it cannot be listed."""
    try:
        return sorted(n for n in os.listdir(directory) if REPORT_NAME.match(n))
    except OSError:
        return []


def prune(directory, keep=KEEP, written=None):
    """Keep the newest `keep` reports, and always `written` (the one just written)."""
    names = [n for n in report_names(directory) if n != written]
    room = max(0, keep - (1 if written else 0))
    for name in names[:max(0, len(names) - room)]:
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            pass


# -- redaction of a command line -------------------------------------------------

MASK = "***"
SECRET_WORDS = ("key", "token", "secret", "password", "passwd", "auth")


def redact_argv(argv, scrub=None):
    """Values of flags that look secret become MASK (--api-key K, --token=K);
    every other argument goes through scrub (default: kept as it is)."""
    out = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(MASK)
            hide_next = False
            continue
        flag, eq, _value = arg.partition("=")
        secret = flag.startswith("-") and any(w in flag.lower() for w in SECRET_WORDS)
        if secret and eq:
            out.append(flag + "=" + MASK)
        else:
            out.append(scrub(arg) if scrub else arg)
            hide_next = secret
    return out


# -- restart causes (the watchdog's; metric label values and alert regexes) -----

NOT_RUNNING = "not-running"
UNREACHABLE = "unreachable"
DEAD_THREAD = "dead-thread"
HEARTBEAT_STALE = "heartbeat-stale"
NO_PROGRESS = "no-progress"
BAD_ANSWER = "bad-answer"
BUSY_TOO_LONG = "busy-too-long"
STALLED_CAUSE = "stalled"  # requests in flight, nothing delivered (the heartbeat's phase)
EXITED = "exited"  # the process was seen to exit (a supervised child)
PORT_TAKEN = "port-taken"  # another process holds the server's port
PLANNED = "planned"  # nothing was wrong (`mlx-watchdog restart`): the server drains first
MEMORY = "memory"  # the memory guard's planned restart (hard line or trend), drained too

# The judge's causes: the server was alive but not serving (MLXRestartedWedged).
WEDGED_CAUSES = (DEAD_THREAD, HEARTBEAT_STALE, STALLED_CAUSE, NO_PROGRESS, BAD_ANSWER,
                 BUSY_TOO_LONG)
# Every value of mlx_watchdog_restarts_total's reason label (counters start at 0).
RESTART_CAUSES = (NOT_RUNNING, UNREACHABLE, EXITED, PORT_TAKEN) + WEDGED_CAUSES + (PLANNED, MEMORY)
