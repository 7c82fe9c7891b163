"""The shim's contract module (sitecustomize/mlx_hotfix/contract.py), for the
watchdog: the heartbeat record's fields, the report folder and its file
names, KEEP, SCHEMA, pruning, argv redaction, the ``.rankN`` suffix, the
MLX_HOTFIX_* names the watchdog sets or reads, and the restart causes.

Loaded once by path as data (as signatures.py loads the shim's table): the
watchdog never imports mlx_hotfix as a package. Every public name of the
shim's module is a name of this one: ``from . import contract`` then
``contract.REPORT_DIR_ENV``.
"""

from __future__ import annotations

from .shim import load_shim_file

SHIM_MODULE = load_shim_file("contract")
globals().update({k: v for k, v in vars(SHIM_MODULE).items()
                  if not k.startswith("_") and k not in ("os", "re", "sys", "time")})
