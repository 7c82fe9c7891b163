"""mlx-watchdog: keep mlx_lm.server serving.

The package has three parts:
- the hotfix shim (shipped as the ``mlx_watchdog/dropin`` folder, a PYTHONPATH
  drop-in with ``sitecustomize.py`` and ``mlx_hotfix``),
- the watchdog daemon and CLI (probe, judge, act),
- launchd and systemd service definitions.
"""

__version__ = "0.1.0"
