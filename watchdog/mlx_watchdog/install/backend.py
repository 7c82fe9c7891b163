"""The one interface install and uninstall use for a service manager, and
where each manager's implementation is found (launchd.py, systemd.py).

install/uninstall (execute.py) never asks which manager it has: what differs
(where files go, what they say, how they are loaded) is behind this.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Protocol

from .. import defaults
from .instance import Instance, Layout

if TYPE_CHECKING:  # pragma: no cover
    from .commands import Runner
    from .plan import Plan


class ServiceBackend(Protocol):
    #: "launchd" or "systemd" (defaults.MANAGERS), as given on the command line.
    manager: str
    #: Whether --system (a system-wide service, as root) exists for it.
    supports_system: bool
    #: Why installing as root (without --system) is probably a mistake.
    root_warning: str

    # ---- names and paths ----
    def service_names(self, name: str) -> List[str]:
        """The server's and the watchdog's service (label or unit), in load order."""

    def definition_paths(self, unit_dir: Path, name: str) -> List[Path]:
        """The two definitions of instance name in unit_dir, as service_names."""

    def standard_layout(self, *, home: Path, system: bool,
                        environ: Mapping[str, str]) -> Layout:
        """Where the files go without --output-dir."""

    def check_executable(self, path: str) -> None:
        """ValueError if the manager cannot run path as a command's first word."""

    # ---- rendering (pure) ----
    def render(self, inst: Instance) -> Dict[Path, bytes]:
        """Every file of one instance, {absolute path: content}: the two
        definitions (server first) and the watchdog config."""

    def restart_action(self, inst: Instance) -> Dict[str, object]:
        """The [restart] table of the generated watch config."""

    # ---- loading and unloading ----
    def load(self, plan: "Plan", runner: "Runner") -> None:
        """Load (or reload, on a re-install) the rendered definitions."""

    def unload(self, name: str, *, system: bool, uid: int, runner: "Runner",
               definitions_present: bool) -> None:
        """Stop both services (the watchdog first) before their files go."""

    def after_removal(self, *, system: bool, runner: "Runner") -> None:
        """What the manager needs once definitions were removed."""

    def installed_notes(self, inst: Instance) -> List[str]:
        """Lines for the user after a successful install (where the logs are)."""


def backend_for(manager: str) -> ServiceBackend:
    if manager == "launchd":
        from .launchd import LaunchdBackend

        return LaunchdBackend()
    if manager == "systemd":
        from .systemd import SystemdBackend

        return SystemdBackend()
    raise ValueError(f"unknown service manager {manager!r} (known: {', '.join(defaults.MANAGERS)})")


def default_layout(manager: str, *, home: Path, system: bool = False,
                   environ: Optional[Mapping[str, str]] = None,
                   output_dir: Optional[Path] = None) -> Layout:
    """The standard layout; output_dir (if given) receives every file the
    installer writes (definitions, TOML, manifest). Runtime paths (state,
    heartbeat, logs) stay where the platform keeps them."""
    layout = backend_for(manager).standard_layout(
        home=Path(home), system=system, environ={} if environ is None else environ)
    if output_dir is not None:
        out = Path(output_dir)
        layout = dataclasses.replace(layout, unit_dir=out, config_dir=out)
    return layout


def state_folders(*, home: Path, environ: Mapping[str, str]) -> List[Path]:
    """Every folder where an installed watchdog keeps its NAME.state.json
    (each manager, user and system; a root watchdog's -root folder too), for
    `status` to find every installed instance."""
    folders: List[Path] = []
    for manager in defaults.MANAGERS:
        backend = backend_for(manager)
        for system in (False, True) if backend.supports_system else (False,):
            state_dir = backend.standard_layout(home=Path(home), system=system,
                                                environ=environ).state_dir
            for folder in (state_dir, state_dir.with_name(state_dir.name + "-root")):
                if system or folder == state_dir:
                    folders.append(folder)
    return list(dict.fromkeys(folders))
