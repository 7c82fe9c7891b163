"""Read back a generated service definition, as its manager would run it:
the command line and the environment of a launchd plist or a systemd unit."""

from __future__ import annotations

import plistlib
import shlex
from pathlib import Path
from typing import Dict, List, Optional, Tuple


def read_definition(path: Path) -> Tuple[Optional[List[str]], Dict[str, str]]:
    """(argv, environment) of a .plist (ProgramArguments, EnvironmentVariables)
    or a systemd unit (ExecStart=, Environment= lines)."""
    if path.suffix == ".plist":
        plist = plistlib.loads(path.read_bytes())
        return plist["ProgramArguments"], plist["EnvironmentVariables"]
    argv, env = None, {}
    for line in path.read_text().splitlines():
        if line.startswith("ExecStart="):
            argv = shlex.split(line[len("ExecStart="):])
        elif line.startswith("Environment="):
            for assignment in shlex.split(line[len("Environment="):]):
                key, _, value = assignment.partition("=")
                env[key] = value
    return argv, env
