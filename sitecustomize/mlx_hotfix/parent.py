"""Exit when the supervisor that started this server is gone.

`mlx-watchdog supervise` sets MLX_HOTFIX_PARENT_PID to its own pid. On Linux
the kernel already ends the child when its supervisor dies
(PR_SET_PDEATHSIG); macOS has no such thing, so a supervisor killed with
SIGKILL, or a closed terminal, would leave the server running unsupervised,
holding its port and the model's memory. A small daemon thread looks once a
second: when the parent is gone (this process was re-parented, or the pid no
longer exists) it sends this process SIGTERM, as the kernel would have.
"""

import os
import signal
import threading
import time

from . import config, log

_started = False
POLL_S = 1.0


def parent_gone(parent_pid, first_ppid):
    if first_ppid == parent_pid and os.getppid() != parent_pid:
        return True  # re-parented (to launchd or init): the supervisor died
    try:
        os.kill(parent_pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass  # exists, not ours to signal
    return False


def _watch(parent_pid, first_ppid):
    while not parent_gone(parent_pid, first_ppid):
        time.sleep(POLL_S)
    log.say("the supervisor (pid %d) is gone; exiting" % parent_pid)
    os.kill(os.getpid(), signal.SIGTERM)
    # A SIGTERM handler that does not exit: wait out the drain and the
    # answers it ends with (the drain part), then go anyway.
    settings = config.current()
    time.sleep(max(10.0, settings.drain_timeout + settings.exit_grace + 5.0))
    os._exit(settings.exit_code)


def watch_parent():
    """Start the watcher once, when MLX_HOTFIX_PARENT_PID names a parent."""
    global _started
    parent_pid = config.current().parent_pid
    if _started or parent_pid is None:
        return
    _started = True
    first_ppid = os.getppid()
    if parent_gone(parent_pid, first_ppid):
        if first_ppid != 1:
            return  # a stale variable inherited some other way: nothing to watch
        first_ppid = parent_pid  # re-parented to init before we looked: gone already
    thread = threading.Thread(target=_watch, args=(parent_pid, first_ppid),
                              name="mlx-hotfix-parent", daemon=True)
    thread.start()
