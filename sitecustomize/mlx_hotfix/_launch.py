"""Every launch form gets every part: how the shim reaches the server module.

``mlx_lm.server`` (the console script), ``python -m mlx_lm server``, and a
script that imports ``mlx_lm.server`` and calls ``main()`` import the module
``mlx_lm.server``: the post-import hooks of ``patches.register_all`` apply
every part there.

``python -m mlx_lm.server`` is the odd one: runpy runs server.py as
``__main__``, nothing imports ``mlx_lm.server``, so no hook fires, and the
module body ends by calling ``main()``. For that form only, this module
watches class creation (``builtins.__build_class__``) until the body has
built its ``APIHandler``, then a profile hook on the main thread waits for
the call of that ``__main__``'s ``main()``: by then every name of the module
is bound. There, before main's first line, ``on_server`` gets the
``__main__`` namespace and applies every registered part whose TARGET is
``mlx_lm.server``, as the import hook would (one registry: patches.PATCHES).
Both hooks remove themselves once used.

Not a patch: it decides when the patches run, never what they do.
"""

import builtins
import os
import sys

from . import log

_SERVER_FILE = os.path.join("mlx_lm", "server.py")


def runs_server_as_main(argv):
    """True if argv (sys.orig_argv) is ``python [options] -m mlx_lm.server ...``."""
    for i, arg in enumerate(argv[1:], start=1):
        if arg == "-m":
            return i + 1 < len(argv) and argv[i + 1] == "mlx_lm.server"
        if arg.startswith("-m"):
            return arg[2:] == "mlx_lm.server"
        if arg == "-c" or not arg.startswith("-"):
            return False
    return False


class Namespace:
    """Attribute access over a module's globals dict (the patches use getattr/setattr)."""

    def __init__(self, namespace):
        object.__setattr__(self, "_namespace", namespace)

    def __getattr__(self, name):
        try:
            return self._namespace[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        self._namespace[name] = value


def _is_server_main(namespace):
    return (namespace.get("__name__") == "__main__"
            and str(namespace.get("__file__", "")).endswith(_SERVER_FILE))


def watch_for_server_as_main(on_server):
    """For ``python -m mlx_lm.server``: on_server(namespace) just before main() runs."""
    if not runs_server_as_main(getattr(sys, "orig_argv", [])):
        return
    original_build_class = builtins.__build_class__

    def build_class(func, name, *args, **kwargs):
        cls = original_build_class(func, name, *args, **kwargs)
        if name == "APIHandler":
            namespace = getattr(func, "__globals__", {})
            if _is_server_main(namespace):
                builtins.__build_class__ = original_build_class
                _before_main(namespace, on_server)
        return cls

    builtins.__build_class__ = build_class
    log.debug("watching for mlx_lm.server run as __main__")


def _before_main(namespace, on_server):
    """Call on_server when the main thread calls namespace's main()."""
    previous = sys.getprofile()

    def profile(frame, event, arg):
        if event == "call" and frame.f_globals is namespace and frame.f_code.co_name == "main":
            sys.setprofile(previous)
            try:
                on_server(Namespace(namespace))
            except Exception:  # noqa: BLE001 - never stop the server from starting
                log.debug_exception()
        elif previous is not None:
            previous(frame, event, arg)

    # Only from here to main(): a few function definitions, so it costs nothing.
    sys.setprofile(profile)
