"""The versions this process runs (mlx-lm, mlx) and the known-bad-pair warning.

Below the patch registry, the heartbeat and the reports: each asks here, so
none of them reaches up into ``patches`` for a version. Called only after
mlx_lm is imported (the drop-in imports only os and sys before that).
"""

import sys


def mlx_lm_version():
    module = sys.modules.get("mlx_lm._version") or sys.modules.get("mlx_lm")
    version = getattr(module, "__version__", None)
    if version is None:
        try:
            from importlib.metadata import version as dist_version

            version = dist_version("mlx-lm")
        except Exception:  # noqa: BLE001
            version = "unknown"
    return str(version)


def mlx_version():
    core = sys.modules.get("mlx.core")
    return str(getattr(core, "__version__", "unknown"))


def pairing_warning():
    """The known-bad-pair or yanked-release line for this process, or None."""
    try:
        from . import pairings

        return pairings.warning_for(mlx_lm_version(), mlx_version(),
                                    pairings.installed_version("transformers"))
    except Exception:  # noqa: BLE001 - a warning must never break start-up
        return None
