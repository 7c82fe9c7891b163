"""Post-import hooks for a few named modules, in the manner of wrapt's.

A hook registered with ``when_imported(name, hook)`` runs once, right after
the module ``name`` has executed, or at once if it already has. The finder
only looks at the names it has hooks for; for those it finds the real spec
through the rest of ``sys.meta_path`` and wraps the loader. Before the
module body runs, the original loader is put back on the module and its
spec, so neither the body nor anything downstream (inspect, pickle, reload,
importlib.resources) ever sees the wrapper. No lock is held while a hook
runs, and a hook that raises is reported, never re-raised into the import.
"""

import sys
import threading

_lock = threading.Lock()
_pending = {}  # module name -> [hook, ...]


def _report(hook, name, exc):
    from . import log

    log.say(
        "a hook for %s failed (%s: %s); the module is left as it is"
        % (name, exc.__class__.__name__, exc)
    )
    log.debug_exception()


def _fire(name, module):
    with _lock:
        hooks = _pending.pop(name, [])
    for hook in hooks:  # outside the lock: a hook may import or register more
        try:
            hook(module)
        except Exception as exc:  # noqa: BLE001
            _report(hook, name, exc)


def when_imported(name, hook):
    """Run hook(module) once, when `name` has been imported (now if it has)."""
    with _lock:
        module = sys.modules.get(name)
        if module is None or _is_initializing(module):
            _pending.setdefault(name, []).append(hook)
            return
    try:
        hook(module)
    except Exception as exc:  # noqa: BLE001
        _report(hook, name, exc)


def _is_initializing(module):
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


class _ChainedLoader:
    """Wraps a loader: restores the real one, runs the module, fires hooks."""

    def __init__(self, loader, name):
        self._loader = loader
        self._name = name

    def __getattr__(self, attribute):
        # get_code, get_source, is_package ... (runpy and inspect use these).
        return getattr(self._loader, attribute)

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def _restore_loader(self, module):
        # Only where the import machinery put this wrapper (or nothing): a
        # loader the module set for itself is left alone, as wrapt does.
        if getattr(module, "__loader__", None) in (None, self):
            try:
                module.__loader__ = self._loader
            except AttributeError:
                pass
        spec = getattr(module, "__spec__", None)
        if spec is not None and getattr(spec, "loader", None) is self:
            spec.loader = self._loader

    def exec_module(self, module):
        self._restore_loader(module)
        self._loader.exec_module(module)
        _fire(self._name, module)


class PostImportFinder:
    """The meta-path finder that attaches _ChainedLoader to watched modules."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _pending:
            return None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _ChainedLoader(spec.loader, fullname)
            return spec
        return None

    def __repr__(self):
        return "<mlx-hotfix post-import hooks for %s>" % ", ".join(sorted(_pending))


finder = PostImportFinder()


def install():
    if finder not in sys.meta_path:
        sys.meta_path.insert(0, finder)
    return finder
