"""mlx-hotfix bootstrap: a PYTHONPATH drop-in for the stock ``mlx_lm.server``.

    PYTHONPATH=/path/to/this/folder mlx_lm.server --model M

Python imports this file at start-up in every process that has the folder on
its path, so it must cost nothing where it is not needed:

- it imports only ``os`` and ``sys`` (both already loaded by ``site``);
- it adds one cheap entry to ``sys.meta_path`` that ignores every module but
  ``mlx_lm``; the real work (``mlx_hotfix``) is imported on the first
  ``import mlx_lm`` and the entry then removes itself;
- it runs the sitecustomize it shadows (the next one on ``sys.path``)
  exactly once;
- it never raises: a broken shim must not stop anything from starting. The
  sitecustomize it chains to is treated as site.py treats one: an Exception
  is reported in site's words and start-up goes on; a ``sys.exit()`` in it
  goes through, and Python stops as it would without the drop-in.

``MLX_HOTFIX=0`` makes it inert: ``sys.modules`` and ``sys.meta_path`` end up
exactly as they would without the folder on the path. A value that is neither
on nor off (``MLX_HOTFIX=garbage``) is named on stderr and the shim stays on.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_OFF_VALUES = ("0", "false", "no", "off")
_ON_VALUES = ("", "1", "true", "yes", "on")

def _say(message):
    try:
        sys.stderr.write("mlx-hotfix: %s\n" % message)
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - no stderr: stay quiet, start anyway
        pass


def _is_dropin_folder(folder):
    # Another copy of this drop-in (say, the installed one and a checkout):
    # chaining into it would run the shim twice.
    return folder == _HERE or (
        os.path.isfile(os.path.join(folder, "sitecustomize.py"))
        and os.path.isfile(os.path.join(folder, "mlx_hotfix", "__init__.py"))
    )


def _path_finder():
    for finder in sys.meta_path:
        if getattr(finder, "__name__", "") == "PathFinder":
            return finder
    return None


def _find_shadowed_spec():
    finder = _path_finder()
    if finder is None:
        return None
    for entry in sys.path:
        folder = os.path.abspath(entry or os.curdir)
        if _is_dropin_folder(folder):
            continue
        spec = finder.find_spec("sitecustomize", [entry])
        if spec is not None and spec.loader is not None:
            return spec
    return None


def _run_shadowed_sitecustomize(inert):
    """Run the next sitecustomize on sys.path, as site would have. Returns it."""
    spec = _find_shadowed_spec()
    if spec is None:
        return None
    module = type(sys)("sitecustomize")
    module.__spec__ = spec
    module.__loader__ = spec.loader
    module.__file__ = spec.origin
    ours = sys.modules.get("sitecustomize")
    # While it runs, `import sitecustomize` inside it must find itself.
    sys.modules["sitecustomize"] = module
    try:
        try:
            spec.loader.exec_module(module)
        except ImportError as exc:
            # What site.py takes for "there is no sitecustomize" (another
            # drop-in that is switched off, say): silent, as site is.
            if exc.name != "sitecustomize":
                raise
            module = None
    except Exception as exc:  # noqa: BLE001 - as site.py does
        # As site.py's execsitecustomize: report an Exception and carry on; a
        # SystemExit or KeyboardInterrupt from the user's file goes through.
        if sys.flags.verbose:
            sys.excepthook(*sys.exc_info())
        else:
            sys.stderr.write(
                "Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
                "%s: %s\n" % (exc.__class__.__name__, exc)
            )
        module = None
    finally:
        if not inert:
            sys.modules["sitecustomize"] = ours
    return module


class _MlxLmImportTrigger:
    """A meta-path entry that waits for ``import mlx_lm``, then hands over.

    It answers None for every other name after one string comparison, so an
    unrelated process only pays that. On the first ``mlx_lm`` import it
    removes itself and activates ``mlx_hotfix``, which installs the real
    post-import hooks.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "mlx_lm" and not fullname.startswith("mlx_lm."):
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        try:
            import mlx_hotfix

            return mlx_hotfix.activate().find_spec(fullname, path, target)
        except Exception as exc:  # noqa: BLE001 - never break the import
            _say("disabled: could not start (%s: %s)" % (exc.__class__.__name__, exc))
            return None

    def __repr__(self):
        return "<mlx-hotfix import trigger>"


def _bootstrap():
    switch = os.environ.get("MLX_HOTFIX", "1")
    inert = switch.strip().lower() in _OFF_VALUES
    if not inert and switch.strip().lower() not in _ON_VALUES:
        # A typo must not pass for a decision: say what was read and what happens.
        _say("MLX_HOTFIX=%r is not 0/1 (or false/true, no/yes, off/on); the shim stays on"
             % switch)
    if inert:
        chained = _run_shadowed_sitecustomize(inert=True)
        if chained is not None:
            # Leave sys.modules exactly as site would have: the user's module.
            sys.modules["sitecustomize"] = chained
            return
        # No other sitecustomize: tell site there is none, which it takes
        # silently and which leaves no trace in sys.modules.
        raise ImportError("mlx-hotfix is off (MLX_HOTFIX=0)", name="sitecustomize")
    try:
        sys.meta_path.insert(0, _MlxLmImportTrigger())
    except Exception as exc:  # noqa: BLE001
        _say("disabled: could not install the import hook (%s)" % exc)
    _run_shadowed_sitecustomize(inert=False)


_bootstrap()
