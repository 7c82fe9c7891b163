"""`mlx-watchdog install` and `uninstall`: launchd agents or systemd units for
a stock mlx_lm.server (with the hotfix shim) and its watchdog.

The command line only: plan.py checks the flags and plans, execute.py writes
and loads (through a backend.ServiceBackend: launchd.py or systemd.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple

import click

from ..defaults import MANAGERS
from .instance import FlagError, InstallError

def _install_help() -> str:
    # From the same constants as the definitions, so the two cannot disagree.
    from .. import defaults as d
    from . import launchd, systemd

    return f"""Install MANAGER (launchd or systemd) definitions for a server and its watchdog.

\b
Writes, for instance NAME (default mlx-PORT):
  - a server definition running `PYTHON -m mlx_lm server --model MODEL
    --host HOST --port PORT [SERVER_ARGS...]` with the hotfix shim on its
    PYTHONPATH and MLX_HOTFIX_HEARTBEAT_FILE set (plus every --env);
  - a watchdog definition running `mlx_watchdog.cli watch --config NAME.toml`;
  - NAME.toml (the watchdog config, with the probe and metrics flags) and
    NAME.install.json (what was written, for uninstall).
Then loads them: launchctl bootout (if loaded) + bootstrap gui/UID, or
systemctl [--user] daemon-reload + enable --now (enable + restart when
updating an existing install). Re-running install updates in place: change
a setting by re-running it with the new flags (the files are rewritten).

\b
launchd: ~/Library/LaunchAgents/io.github.mlx-watchdog.NAME.{{server,watchdog}}.plist,
  logs in ~/Library/Logs/mlx-watchdog/. The server has KeepAlive
  {{SuccessfulExit: false, Crashed: true}} (exit {d.SHIM_EXIT_CODE} restarts) and
  ThrottleInterval {launchd.SERVER_THROTTLE_INTERVAL} (default 10): launchd's respawn
  throttle is its only storm control; it only delays a server that dies within
  {launchd.SERVER_THROTTLE_INTERVAL} s of its launch (a crash loop), not one that ran for
  hours. ProcessType Interactive keeps the server out of background (App
  Nap-style) throttling. The server plist's Sockets entry holds the
  listening socket (--no-socket: none).
systemd: ~/.config/systemd/user/NAME-{{server,watchdog}}.service (--system:
  /etc/systemd/system), logs in the journal. The server is Type=notify with
  WatchdogSec={systemd.WATCHDOG_SEC}, TimeoutStartSec={systemd.TIMEOUT_START_SEC},
  Restart=on-failure, RestartSec={systemd.RESTART_SEC}, and no start limit
  (StartLimitIntervalSec={systemd.START_LIMIT_INTERVAL_SEC}): it is never left failed
  for good. The watchdog restarts a server that served at once, and backs off
  only starts that never serve ({d.BACKOFF_INITIAL_S:g} s doubling to
  {d.BACKOFF_MAX_S:g} s). NAME-server.socket holds the listening socket
  (--no-socket: none).

\b
Example (server flags after --):
  mlx-watchdog install systemd --model ~/models/qwen --port 8080 \\
      --metrics-port 9464 --env MLX_HOTFIX_STALL_TIMEOUT=60 -- --max-tokens 4096
"""


def _watch_option(flag: str, key: str, default_name: str, text: str, *,
                  integer: bool = False, zero: bool = False):
    """A probe flag written into NAME.toml as `key` (only when given)."""
    from .. import defaults

    default = getattr(defaults, default_name)
    if integer:
        kind: click.ParamType = click.IntRange(min=1)
    else:
        kind = click.FloatRange(min=0, min_open=not zero, max=1e7)
    return click.option(flag, key, type=kind, default=None,
                        help=f"{text} [default: {default:g}]")


def _memory_setting(value: Optional[str], what: str) -> object:
    """A memory flag's value as the watch config's key takes it (checked here,
    so a mistake is named before anything is written)."""
    from ..memory import MemoryLimitError, parse_duration, parse_memory_limit

    if value is None:
        return None
    try:
        if what == "limit":
            parse_memory_limit(value)
            return value.strip()
        return parse_duration(value, what)
    except (MemoryLimitError, ValueError) as exc:
        raise click.BadParameter(str(exc)) from None


def _flag_error(exc: FlagError) -> click.BadParameter:
    return click.BadParameter(exc.message, param_hint=[exc.flag])


@click.command("install", help=_install_help(),
               context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("manager", type=click.Choice(MANAGERS))
@click.option("--model", required=True,
              help="Model directory (must exist) or Hugging Face repo id (fetched by the server).")
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True,
              help="Server port; must be free on HOST.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Server bind address.")
@click.option("--name", default=None,
              help="Instance name, [A-Za-z0-9_.-]+ (default: mlx-PORT). One name per server.")
@click.option("--python", "python", default=None,
              help="Python whose stock mlx_lm runs the server (default: this Python).")
@click.option("--watchdog-python", default=None,
              help="Python with mlx_watchdog installed, for the watchdog (default: this Python).")
@click.option("--shim-dir", default=None,
              help="Hotfix drop-in folder for PYTHONPATH (default: `mlx-watchdog shim-path`).")
@click.option("--offline", is_flag=True, help="Set HF_HUB_OFFLINE=1 for the server.")
@click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write the definitions, config and manifest here instead of the standard "
                   "directories.")
@click.option("--dry-run", is_flag=True,
              help="Write the files, print the launchctl/systemctl commands, run nothing.")
@click.option("--system", is_flag=True,
              help="systemd only: a system service in /etc/systemd/system (needs root).")
@click.option("--user-name", default=None,
              help="systemd --system only: run the server as this user (User=).")
@click.option("--hostfile", default=None,
              help="A distributed group: mlx.launch's JSON hostfile (rank 0 first). Every "
                   "host must be reachable by ssh without a prompt, or be this machine.")
@click.option("--hosts", "group_hosts", default=None,
              help="A distributed group: mlx.launch --hosts, comma-separated.")
@click.option("--backend", default=None,
              help="A distributed group: mlx.launch --backend (ring, jaccl, mpi...).")
@click.option("--remote-shim-path", default=None,
              help="A distributed group: the hotfix shim folder on the other hosts "
                   "(default: the same path as --shim-dir).")
@click.option("--env", "server_env", multiple=True, metavar="KEY=VALUE",
              help="Set a variable in the server's environment, e.g. "
                   "MLX_HOTFIX_STALL_TIMEOUT=60 or MLX_HOTFIX_RECOVER=thread (repeatable; see "
                   "docs/reference.md, the shim's variables).")
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None,
              help="The watchdog serves Prometheus metrics on this port (off unless given).")
@click.option("--metrics-host", default=None,
              help="Address for the metrics server [default: 127.0.0.1]; 0.0.0.0 (or the "
                   "LAN address) for a Prometheus on another machine.")
@_watch_option("--probe-interval", "interval", "PROBE_INTERVAL_S", "Seconds between probes.")
@_watch_option("--probe-timeout", "timeout", "PROBE_TIMEOUT_S", "Seconds for one whole probe.")
@_watch_option("--failures", "failures", "FAILURES",
               "Consecutive failed probes without progress before a restart.", integer=True)
@_watch_option("--boot-grace", "boot_grace", "BOOT_GRACE_S",
               "Seconds after each start during which failures do not count.", zero=True)
@_watch_option("--heartbeat-timeout", "heartbeat_timeout", "HEARTBEAT_TIMEOUT_S",
               "Seconds without a heartbeat after which the loop counts as hung.")
@_watch_option("--max-busy", "max_busy", "MAX_BUSY_S",
               "Seconds a server may look busy without answering (0: no limit).", zero=True)
@_watch_option("--stop-grace", "stop_grace", "STOP_GRACE_S",
               "Seconds between SIGTERM and SIGKILL for the watchdog's restarts.", zero=True)
@click.option("--memory-limit", "memory_limit", default=None,
              callback=lambda ctx, param, value: _memory_setting(value, "limit"),
              help="The memory guard's limit: 48G, 512M, 80% of RAM, auto or off "
                   "[default: auto: macOS only]. See `mlx-watchdog supervise --help`.")
@click.option("--memory-horizon", "memory_horizon", default=None,
              callback=lambda ctx, param, value: _memory_setting(value, "--memory-horizon"),
              help="A planned restart when the memory trend reaches the hard line within "
                   "this long (seconds, or 30m, 6h) [default: 6h].")
@click.option("--memory-idle-wait", "memory_idle_wait", default=None,
              callback=lambda ctx, param, value: _memory_setting(value, "--memory-idle-wait"),
              help="A memory restart waits up to this long for no request in flight "
                   "(seconds, or 90s, 5m) [default: 5m].")
@click.option("--allow-sleep", "allow_sleep", is_flag=True,
              help="launchd: let the Mac sleep while the server runs. By default the "
                   "watchdog runs `caffeinate -i -s -w <server pid>` (a Mac asleep "
                   "mid-generation is a hang to every client).")
@click.option("--socket/--no-socket", "listen_socket", default=True, show_default=True,
              help="The service manager holds the server's listening socket (a systemd .socket "
                   "unit, a launchd Sockets entry) and the server inherits it: connections "
                   "wait while it restarts instead of being refused. --no-socket: the server "
                   "binds its port itself. (Groups always bind on rank 0.)")
@click.argument("server_args", nargs=-1, type=click.UNPROCESSED)
def install_command(manager: str, model: str, port: int, host: str, name: Optional[str],
                    python: Optional[str], watchdog_python: Optional[str],
                    shim_dir: Optional[str], offline: bool, output_dir: Optional[Path],
                    dry_run: bool, system: bool, user_name: Optional[str],
                    hostfile: Optional[str], group_hosts: Optional[str],
                    backend: Optional[str], remote_shim_path: Optional[str],
                    server_env: Tuple[str, ...], metrics_port: Optional[int],
                    metrics_host: Optional[str], listen_socket: bool,
                    server_args: Tuple[str, ...], **watch_settings: object) -> None:
    from . import execute, plan

    allow_sleep = bool(watch_settings.pop("allow_sleep", False))
    if allow_sleep and manager != "launchd":
        raise click.BadParameter("is for launchd only (systemd machines do not sleep by "
                                 "default)", param_hint=["--allow-sleep"])
    if manager == "launchd" and not allow_sleep:
        watch_settings["caffeinate"] = True
    try:
        planned = plan.prepare(
            server_env=server_env, metrics_port=metrics_port, metrics_host=metrics_host,
            watch_settings={k: v for k, v in watch_settings.items() if v is not None},
            manager=manager, model=model, port=port, host=host, name=name, python=python,
            watchdog_python=watchdog_python, shim_dir=shim_dir, offline=offline,
            output_dir=output_dir, dry_run=dry_run, system=system, user_name=user_name,
            server_args=server_args, hostfile=hostfile, group_hosts=group_hosts,
            group_backend=backend, remote_shim_path=remote_shim_path,
            listen_socket=listen_socket,
        )
    except FlagError as exc:
        raise _flag_error(exc) from exc
    try:
        execute.apply(planned)
    except InstallError as exc:
        raise click.ClickException(str(exc)) from exc


@click.command("uninstall", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("manager", type=click.Choice(MANAGERS))
@click.option("--name", default=None,
              help="Instance name (default: mlx-PORT with --port, or the only installed one).")
@click.option("--port", type=click.IntRange(1, 65535), default=None,
              help="Derive the default name mlx-PORT.")
@click.option("--system", is_flag=True, help="systemd only: the system service.")
@click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The --output-dir given to install.")
@click.option("--dry-run", is_flag=True, help="Print what would be run and removed.")
def uninstall_command(manager: str, name: Optional[str], port: Optional[int], system: bool,
                      output_dir: Optional[Path], dry_run: bool) -> None:
    """Stop and remove what `install MANAGER` installed for one instance.

    launchctl bootout gui/UID/LABEL (watchdog, then server), or systemctl
    [--user] disable --now + daemon-reload; then removes the definitions,
    the generated config and the manifest. Nothing else: state, heartbeat and
    log files are kept, and a file not written by install is never removed.
    """
    from . import execute

    try:
        execute.uninstall(manager, name=name, port=port, system=system, output_dir=output_dir,
                          dry_run=dry_run)
    except FlagError as exc:
        raise _flag_error(exc) from exc
    except InstallError as exc:
        raise click.ClickException(str(exc)) from exc
