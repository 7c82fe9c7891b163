"""Bench-only: stamp the moment an exception leaves the generation step.

Put this folder on PYTHONPATH after the shim's (the shim chains into the
sitecustomize it shadows) or alone (stock). When an exception escapes
``mlx_lm.generate.BatchGenerator.next`` -- the call the server's generation
loop makes once per step, in 0.31.x and 0.32.x alike -- it writes one line to
stderr, then re-raises the exception unchanged:

    bench-death: TypeError: 'NoneType' object is not iterable t=<time.time()>

That is the moment the generation thread starts to die: nothing between
there and the thread's top frame catches it (stock 0.31.x: the thread ends;
0.32.x: _run_generate catches it; with the shim, its wrapper sees it first).
bench/death_to_exit.py uses it for the natural ``extend`` crash, where there
is no injected fault to announce the death. It prints at most once per
process and never changes behaviour otherwise.
"""

import sys
import time

_TARGET = "mlx_lm.generate"
_stamped = [False]


def _wrap(owner, name):
    original = getattr(owner, name)

    def stamped(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except BaseException as exc:
            if not _stamped[0]:
                _stamped[0] = True
                message = (str(exc).strip().splitlines() or ["(no message)"])[0][:200]
                sys.stderr.write("bench-death: %s: %s t=%.6f\n"
                                 % (exc.__class__.__name__, message, time.time()))
                sys.stderr.flush()
            raise

    stamped.__name__ = getattr(original, "__name__", name)
    stamped.__wrapped__ = original
    setattr(owner, name, stamped)


class _Finder:
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        loader = spec.loader

        class Loader:
            def create_module(self, spec):
                return None

            def exec_module(self, module):
                loader.exec_module(module)
                _wrap(module.BatchGenerator, "next")

        spec.loader = Loader()
        return spec


sys.meta_path.insert(0, _Finder())
