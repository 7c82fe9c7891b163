"""From install's flags to a Plan: every flag checked (hostcheck.py for what
needs the host), the Instance to render, and what is already installed."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence, Tuple

import click

from .. import contract, defaults
from . import hostcheck
from .backend import ServiceBackend, backend_for, default_layout
from .instance import (FlagError, Instance, check_name, check_user_name, default_name,
                       listen_address, manifest_path)
from .manifest import Manifest, other_instances_on_port


@dataclass(frozen=True)
class Plan:
    """One install, checked and ready to write and load."""

    inst: Instance
    backend: ServiceBackend
    #: The manifest of a previous install of this name (a dry run's included).
    existing: Optional[Manifest]
    dry_run: bool
    uid: int
    #: The definitions go to --output-dir, not where the manager looks.
    custom_dir: bool

    @property
    def live(self) -> Optional[Manifest]:
        """The previous install, if it was really loaded (not a dry run)."""
        return self.existing if self.existing is not None and not self.existing.dry_run else None

    @property
    def reinstall(self) -> bool:
        return self.live is not None


def _has_control_character(value: str) -> bool:
    return any(ord(c) < 0x20 or ord(c) == 0x7F for c in value)


def _check_server_args(server_args: Sequence[str]) -> None:
    for arg in server_args:
        if _has_control_character(arg):
            raise FlagError("SERVER_ARGS", f"{arg!r} contains a control character")
        flag = arg.split("=", 1)[0]
        if flag in ("--host", "--port", "--model"):
            # The server would listen (or load) elsewhere than the watchdog
            # probes, and a --host after -- could expose it on every interface.
            raise FlagError("SERVER_ARGS", f"{flag} after -- is not allowed: give it as "
                                           f"install's own {flag} (before --)")


# Set by install itself: an --env may not change where the shim comes from or
# where its heartbeat and reports go, or the watchdog would judge another
# server or look for stacks in another folder; nor which launchd socket the
# server asks for (the plist's own Sockets entry).
_RESERVED_ENV = ("PYTHONPATH", defaults.HEARTBEAT_ENV, defaults.INSTANCE_ENV,
                 defaults.REPORT_DIR_ENV, contract.LAUNCHD_SOCKET_ENV)


def _check_server_env(assignments: Sequence[str]) -> Tuple[Tuple[str, str], ...]:
    """--env KEY=VALUE flags as pairs; FlagError for a malformed or reserved one.
    An MLX_HOTFIX_ name the shim does not list gets a warning (a typo is
    otherwise silently ignored by the server)."""
    known = _shim_variables()
    pairs = []
    for assignment in assignments:
        key, eq, value = assignment.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise FlagError("--env", f"{assignment!r}: expected KEY=VALUE, e.g. "
                                     "MLX_HOTFIX_STALL_TIMEOUT=60")
        if key in _RESERVED_ENV:
            raise FlagError("--env", f"{key} is set by install itself")
        if _has_control_character(value):
            raise FlagError("--env", f"{assignment!r} contains a control character")
        if key.startswith("MLX_HOTFIX") and known and key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            click.echo(f"warning: --env {key}: the hotfix shim does not know this variable"
                       f"{hint}", err=True)
        pairs.append((key, value))
    return tuple(pairs)


def _shim_variables() -> "set[str]":
    """The MLX_HOTFIX_* names the shim reads, from its config module (read as
    data, never imported: the watchdog does not import the shim)."""
    from ..shim import shim_dir

    try:
        text = (shim_dir() / "mlx_hotfix" / "config.py").read_text()
    except (OSError, FileNotFoundError):
        return set()
    return set(re.findall(r"\bMLX_HOTFIX(?:_[A-Z0-9]+)*\b", text))


def prepare(*, manager: str, model: str, port: int, host: str, name: Optional[str],
            python: Optional[str], watchdog_python: Optional[str], shim_dir: Optional[str],
            offline: bool, output_dir: Optional[Path], dry_run: bool, system: bool,
            user_name: Optional[str], server_args: Sequence[str],
            hostfile: Optional[str] = None, group_hosts: Optional[str] = None,
            group_backend: Optional[str] = None,
            remote_shim_path: Optional[str] = None,
            server_env: Sequence[str] = (), metrics_port: Optional[int] = None,
            metrics_host: Optional[str] = None,
            watch_settings: Optional[Mapping[str, object]] = None,
            listen_socket: bool = True) -> Plan:
    """Check every flag (FlagError names the first bad one) and plan the install."""
    backend = backend_for(manager)
    if system and not backend.supports_system:
        raise FlagError("--system", "is for systemd only (launchd installs LaunchAgents)")
    if user_name is not None:
        if not system:
            raise FlagError("--user-name", "only applies with --system")
        check_user_name(user_name)
        hostcheck.check_user_exists(user_name)
    if user_name == "root":
        user_name = None
    name = check_name(name if name is not None else default_name(port))
    _check_server_args(server_args)
    if not host:
        raise FlagError("--host", "must not be empty")
    for flag, value in (("--model", model), ("--host", host), ("--python", python),
                        ("--watchdog-python", watchdog_python), ("--shim-dir", shim_dir)):
        if value is not None and _has_control_character(value):
            raise FlagError(flag, f"{value!r} contains a control character (a newline?)")

    extra_env = _check_server_env(server_env)
    if metrics_host is not None and (not metrics_host or _has_control_character(metrics_host)):
        raise FlagError("--metrics-host", f"{metrics_host!r} is not an address")
    server_python = hostcheck.resolve_executable(python or sys.executable, "--python")
    hostcheck.check_python_module(server_python, "mlx_lm", "--python")
    if watchdog_python is None:
        wd_python = os.path.abspath(sys.executable)
    else:
        wd_python = hostcheck.resolve_executable(watchdog_python, "--watchdog-python")
        hostcheck.check_python_module(wd_python, "mlx_watchdog", "--watchdog-python")
    for flag, path in (("--python", server_python), ("--watchdog-python", wd_python)):
        try:
            backend.check_executable(path)
        except ValueError as exc:
            raise FlagError(flag, str(exc)) from None

    model_value, local = hostcheck.resolve_model(model)
    if not local:
        hint = " and be in the local cache (--offline)" if offline else ""
        click.echo(f"warning: --model {model!r} is not a local path; the server will treat it "
                   f"as a Hugging Face repo id, which must exist{hint}.", err=True)
    shim_path = hostcheck.resolve_shim_dir(shim_dir)

    home = Path.home()
    layout = default_layout(manager, home=home, system=system, environ=os.environ,
                            output_dir=output_dir)
    standard = backend.standard_layout(home=home, system=system, environ=os.environ)
    existing = Manifest.load(manifest_path(layout, name))
    if existing is not None and existing.manager != manager:
        raise FlagError("--name", f"{name!r} is installed for {existing.manager} in "
                                  f"{layout.config_dir}; choose another --name or --output-dir")

    others = other_instances_on_port(layout, name, port)
    if others:
        raise FlagError("--port", f"{port} is already used by installed instance "
                                  f"{', '.join(others)}")
    uid = os.getuid() if hasattr(os, "getuid") else 0
    plan = Plan(
        inst=Instance(
            manager=manager, name=name, model=model_value, host=host, port=port,
            python=server_python, watchdog_python=wd_python, shim_dir=shim_path,
            layout=layout, server_args=tuple(server_args), offline=offline, system=system,
            user_name=user_name, watchdog_launcher=hostcheck.watchdog_launcher(wd_python),
            server_extra_env=extra_env, metrics_port=metrics_port, metrics_host=metrics_host,
            watch_settings=tuple(sorted((watch_settings or {}).items())),
            listen_socket=listen_socket,
        ),
        backend=backend, existing=existing, dry_run=dry_run, uid=uid,
        custom_dir=Path(layout.unit_dir) != standard.unit_dir,
    )
    if not (plan.live is not None and plan.live.port == port and plan.live.host == host):
        # (On a re-install the port is probably held by this instance's own server.)
        hostcheck.check_port_free(host, port)

    if uid == 0 and not dry_run and not system:
        click.echo(f"warning: running as root: {backend.root_warning}", err=True)

    launch = hostcheck.group_launch(python=server_python, hostfile=hostfile, hosts=group_hosts,
                                    backend=group_backend)
    if launch:
        plan = dataclasses.replace(plan, inst=dataclasses.replace(
            plan.inst, group_launch=launch, remote_shim_dir=remote_shim_path or shim_path))
    if plan.inst.held_socket:
        try:
            listen_address(host)
        except ValueError as exc:
            raise FlagError("--host", str(exc)) from None
    return plan
