"""Where the hotfix drop-in lives, and how to put it in front of a command.

Follows the opentelemetry-instrument launcher: prepend the bootstrap folder to
PYTHONPATH, then exec the command.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Mapping, MutableMapping, Optional

PYTHONPATH = "PYTHONPATH"


def shim_dir() -> Path:
    """The folder to put on PYTHONPATH: it holds sitecustomize.py and mlx_hotfix/."""
    try:
        spec = importlib.util.find_spec("mlx_watchdog.dropin")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location)
            if (candidate / "sitecustomize.py").is_file():
                return candidate.resolve()
    # A plain checkout run with watchdog/ on sys.path: the folder is a sibling.
    candidate = Path(__file__).resolve().parents[2] / "sitecustomize"
    if (candidate / "sitecustomize.py").is_file():
        return candidate
    raise FileNotFoundError(
        "mlx-watchdog: the hotfix drop-in folder (sitecustomize.py + mlx_hotfix/) "
        "is missing from this installation"
    )


def with_shim(env: Optional[Mapping[str, str]] = None) -> MutableMapping[str, str]:
    """A copy of env (default: os.environ) with the drop-in first on PYTHONPATH."""
    result = dict(os.environ if env is None else env)
    folder = str(shim_dir())
    parts = [p for p in result.get(PYTHONPATH, "").split(os.pathsep) if p]
    parts = [folder] + [p for p in parts if os.path.abspath(p) != folder]
    result[PYTHONPATH] = os.pathsep.join(parts)
    return result



def load_shim_file(name: str) -> Any:
    """The drop-in's mlx_hotfix/<name>.py, loaded by path as a standalone
    module (its data and plain functions): the watchdog never imports
    mlx_hotfix as a package, whose import would arm the shim's hooks."""
    path = shim_dir() / "mlx_hotfix" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"mlx_watchdog_shim_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
