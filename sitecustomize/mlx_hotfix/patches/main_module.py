"""``python -m mlx_lm.server``: the server runs as ``__main__``, not as
``mlx_lm.server``, so no import hook sees it, and its last line calls main()
right after the classes are defined.

For that one launch form the shim watches class creation: when the
``APIHandler`` class of a ``__main__`` loaded from ``mlx_lm/server.py`` has
been built, the module's namespace holds everything the exit patch needs, so
it is patched there, before main() runs. The class-creation hook is then
removed. Other launch forms (``mlx_lm.server``, ``python -m mlx_lm server``,
a script calling ``mlx_lm.server.main()``) import the module normally.
"""

import builtins
import os
import sys

from .. import config, log

_SERVER_FILE = os.path.join("mlx_lm", "server.py")


def _runs_server_as_main(argv):
    for i, arg in enumerate(argv[1:], start=1):
        if arg == "-m":
            return i + 1 < len(argv) and argv[i + 1] == "mlx_lm.server"
        if arg.startswith("-m"):
            return arg[2:] == "mlx_lm.server"
        if arg == "-c" or not arg.startswith("-"):
            return False
    return False


class _Namespace:
    """Attribute access over a module's globals dict (the patches use getattr)."""

    def __init__(self, namespace):
        object.__setattr__(self, "_namespace", namespace)

    def __getattr__(self, name):
        try:
            return self._namespace[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        self._namespace[name] = value


def watch_for_server_as_main():
    if not _runs_server_as_main(getattr(sys, "orig_argv", [])):
        return
    from . import drain, exit_on_death, heartbeat, held_socket, report_status, try_apply

    original_build_class = builtins.__build_class__

    def build_class(func, name, *args, **kwargs):
        cls = original_build_class(func, name, *args, **kwargs)
        if name == "APIHandler":
            namespace = getattr(func, "__globals__", {})
            if namespace.get("__name__") == "__main__" and str(
                namespace.get("__file__", "")
            ).endswith(_SERVER_FILE):
                builtins.__build_class__ = original_build_class
                namespace["APIHandler"] = cls
                for patch in (exit_on_death, heartbeat, drain, held_socket):
                    if config.current().enabled(patch.NAME):
                        try_apply(patch, _Namespace(namespace))
                report_status()
        return cls

    builtins.__build_class__ = build_class
    log.debug("watching for mlx_lm.server run as __main__")
