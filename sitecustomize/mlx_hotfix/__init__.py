"""mlx-hotfix: runtime fixes for the stock mlx_lm.server.

Activated by the drop-in's sitecustomize.py on the first ``import mlx_lm``.
Every fix is a small module in ``mlx_hotfix.patches`` that carries its gate
(version range plus a check of the target's shape), its off switch (a name
for MLX_HOTFIX_DISABLE), its reason (the upstream issue) and its test.
A fix that does not fit the installed mlx-lm is skipped with one line; the
shim never stops the server from starting.
"""

from . import _hooks, config, log

__all__ = ["activate", "when_imported"]

when_imported = _hooks.when_imported
_finder = None


def activate():
    """Install the post-import hooks for every enabled patch. Idempotent."""
    global _finder
    if _finder is not None:
        return _finder
    settings = config.current()
    for warning in settings.warnings:
        log.say(warning)
    _finder = _hooks.install()
    from . import patches

    patches.register_all()
    try:
        from . import parent

        parent.watch_parent()
    except Exception:  # noqa: BLE001 - never break the import
        log.debug_exception()
    return _finder
