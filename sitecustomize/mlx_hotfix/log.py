"""One-line messages on stderr, all prefixed ``mlx-hotfix:``.

The shim talks rarely and briefly: one status line when the server module
loads, one line when the generation thread dies. MLX_HOTFIX_DEBUG=1 adds
detail.
"""

import sys

from . import config

PREFIX = "mlx-hotfix: "


_who = None


def _prefix():
    # In a distributed group every rank writes to the same launcher output:
    # name the rank and host ("mlx-hotfix: [rank 1 on studio-2] ...").
    global _who
    if _who is None:
        from .group import describe, rank

        _who = "[%s] " % describe() if rank() is not None else ""
    return PREFIX + _who


def say(message):
    try:
        sys.stderr.write(_prefix() + message + "\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - stderr may be closed; never fail for it
        pass


def debug(message):
    if config.current().debug:
        say("debug: " + message)


def debug_exception():
    if config.current().debug:
        import traceback

        try:
            traceback.print_exc(file=sys.stderr)
        except Exception:  # noqa: BLE001
            pass
