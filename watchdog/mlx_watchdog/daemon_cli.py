"""probe, supervise, watch and status: the watchdog's commands."""

from __future__ import annotations

import os
import shlex
import tempfile
from pathlib import Path
from typing import Callable, Optional, Tuple

import click

from . import defaults
from .control import control_dir
from .log import FORMATS, Events, setup_logging
from .metrics import Metrics
from .probe_cli import (  # noqa: F401 - probe_command is re-exported
    _SECONDS,
    _SECONDS_OR_ZERO,
    _api_key_option,
    _cacert_option,
    _check_url,
    _health_option,
    _model_option,
    probe_command,
)
from .redact import secret
from .state import StateStore, default_state_path
from .status_cli import state_file_option


def _number_option(
    flag: str, default: float, text: str, kind: click.ParamType = _SECONDS
) -> Callable:
    return click.option(flag, type=kind, default=default, show_default=True, help=text)


def _check_memory_limit(ctx, param, value):
    from .memory import MemoryLimitError, parse_memory_limit

    try:
        parse_memory_limit(value)
    except MemoryLimitError as exc:
        raise click.BadParameter(str(exc)) from None
    return value.strip()


def _check_duration(ctx, param, value):
    from .memory import parse_duration

    try:
        return parse_duration(value, param.opts[0])
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def memory_options(f: Callable) -> Callable:
    """--memory-limit, --memory-horizon, --memory-idle-wait (supervise; install
    passes them on)."""
    f = click.option(
        "--memory-idle-wait", default=f"{defaults.MEMORY_IDLE_WAIT_S / 60:g}m",
        show_default=True, callback=_check_duration,
        help="A memory restart waits up to this long for a moment with no request in "
        "flight, then restarts at once (always drained). Seconds, or 90s, 5m, 1h.")(f)
    f = click.option(
        "--memory-horizon", default=f"{defaults.MEMORY_HORIZON_S / 3600:g}h",
        show_default=True, callback=_check_duration,
        help="Restart (planned, drained) when the trend of the last hour's memory says "
        "the hard line (95% of --memory-limit) is crossed within this long.")(f)
    f = click.option(
        "--memory-limit", default=defaults.MEMORY_LIMIT, show_default=True,
        callback=_check_memory_limit,
        help="The memory guard's limit for the server: bytes with a unit (48G, 512M), a "
        "share of RAM (80%), auto (macOS: the smaller of RAM minus 8 GiB and the GPU "
        "wired cap; off elsewhere) or off. At 85% the server is asked to trim and its "
        "/health answers 503 memory; at 95% (or when the trend gets there within "
        "--memory-horizon) it gets a planned, drained restart.")(f)
    return f


def _daemon_options(f: Callable) -> Callable:
    f = state_file_option(f)
    f = click.option(
        "--log-format",
        type=click.Choice(FORMATS),
        default=None,
        help=f"text for people, json for one object per line. [default: {defaults.LOG_FORMAT}]",
    )(f)
    f = click.option(
        "--metrics-host",
        default=None,
        help=f"Address for the metrics server. [default: {defaults.METRICS_HOST}]",
    )(f)
    f = click.option(
        "--metrics-port",
        type=click.IntRange(1, 65535),
        default=None,
        help="Serve Prometheus metrics on this port (off unless given).",
    )(f)
    return f


@click.command(
    "supervise",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option(
    "--url",
    default=None,
    callback=_check_url,
    help="Where to probe. [default: from the command's --host/--port; mlx_lm.server's "
    f"own {defaults.URL} when it has none; an error when the port cannot be read]",
)
@click.option(
    "--name", default=None, callback=lambda ctx, param, value: _check_name(value),
    help="Instance name in logs, metrics and status: letters, digits and _ . : - [ ]. "
    "[default: host:port]",
)
@_number_option("--probe-interval", defaults.PROBE_INTERVAL_S, "Seconds between probes.")
@_number_option("--probe-timeout", defaults.PROBE_TIMEOUT_S, "Seconds for one whole probe.")
@_number_option(
    "--failures",
    defaults.FAILURES,
    "Consecutive failed probes without progress before a restart (with the shim, one "
    "is enough once its heartbeat is stale; see --heartbeat-timeout).",
    kind=click.IntRange(min=1),
)
@_number_option(
    "--boot-grace",
    defaults.BOOT_GRACE_S,
    "Seconds after each start during which failures do not count (ends early at the "
    "first good probe, or when the shim's heartbeat says the model is loaded and serving).",
    kind=_SECONDS_OR_ZERO,
)
@_number_option(
    "--max-busy",
    defaults.MAX_BUSY_S,
    "Seconds a server may look busy (CPU) without answering a probe before it counts "
    "as wedged; 0: no limit. An advancing shim heartbeat is never limited.",
    kind=_SECONDS_OR_ZERO,
)
@_number_option(
    "--heartbeat-timeout",
    defaults.HEARTBEAT_TIMEOUT_S,
    "Seconds without a beat from the shim's generation loop after which it counts as "
    "hung: then one failed probe is enough for a restart. Raise it for huge models whose "
    "single prefill step takes longer.",
)
@_number_option(
    "--cpu-busy",
    defaults.CPU_BUSY_FRACTION,
    "Without a heartbeat (--no-shim): the share of one core the server (with its "
    "children) must use over an interval for a failed probe to count as busy.",
    kind=_SECONDS_OR_ZERO,
)
@_number_option(
    "--stop-grace",
    defaults.STOP_GRACE_S,
    "Seconds between SIGTERM and SIGKILL. Generous on purpose: SIGKILL of a process "
    "holding a large wired model on macOS has been reported to leak that memory.",
    kind=_SECONDS_OR_ZERO,
)
@_number_option(
    "--max-restarts",
    defaults.MAX_RESTARTS,
    "This many restarts per --restart-window shows as crash-looping (in logs, metrics "
    "and status); restarts go on at the backoff's pace.",
    kind=click.IntRange(min=1),
)
@_number_option(
    "--backoff-max",
    defaults.BACKOFF_MAX_S,
    "The longest wait before restarting a server that never served; the wait starts "
    "at 1 s and doubles. A server that served is restarted at once.",
    kind=_SECONDS_OR_ZERO,
)
@click.option("--backoff-reset", type=_SECONDS_OR_ZERO, default=None, hidden=True,
              help="No longer used (a start that served ends the backoff); accepted "
              "with a warning.")
@click.option(
    "--report-dir",
    type=click.Path(file_okay=False),
    default=None,
    help=f"Where crash reports go (also given to the shim as {defaults.REPORT_DIR_ENV}). "
    "[default: $MLX_HOTFIX_REPORT_DIR, ~/Library/Logs/mlx-watchdog/reports on macOS, "
    "$XDG_STATE_HOME/mlx-watchdog/reports elsewhere]",
)
@_number_option("--restart-window", defaults.RESTART_WINDOW_S, "Seconds, see --max-restarts.")
@click.option(
    "--no-shim",
    is_flag=True,
    help="Do not put the hotfix shim on the child's PYTHONPATH (no clean exit on a dead "
    "generation thread, no heartbeat).",
)
@click.option(
    "--listener-check/--no-listener-check",
    default=True,
    show_default=True,
    help="Count a probe only when the child (or one of its descendants) holds the URL's "
    "listening port, so a server of someone else's on that port is never taken for ours. "
    "Turn off when the port is held by something the child does not own (a container "
    "runtime's proxy, say).",
)
@click.option(
    "--socket/--no-socket",
    "hold_socket",
    default=True,
    show_default=True,
    help="Bind the server's --host/--port here, once, and hand the listening socket to "
    "every child (systemd's LISTEN_FDS protocol; the shim serves on it): connections that "
    "arrive while the server restarts wait for the next one instead of being refused. "
    "--no-socket: each child binds the port itself, as without mlx-watchdog. Off by itself "
    "with --no-shim and for mlx.launch groups (rank 0 binds).",
)
@click.option(
    "--remote-shim-path",
    default=None,
    help="mlx.launch groups: the hotfix shim folder on the remote hosts, passed to their "
    "ranks with --env PYTHONPATH=. [default: the same path as here]",
)
@memory_options
@_model_option
@_api_key_option
@_health_option
@_cacert_option
@_daemon_options
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def supervise_command(
    url: Optional[str],
    name: Optional[str],
    probe_interval: float,
    probe_timeout: float,
    failures: int,
    boot_grace: float,
    max_busy: float,
    heartbeat_timeout: float,
    cpu_busy: float,
    stop_grace: float,
    max_restarts: int,
    backoff_max: float,
    backoff_reset: Optional[float],
    report_dir: Optional[str],
    restart_window: float,
    no_shim: bool,
    listener_check: bool,
    hold_socket: bool,
    remote_shim_path: Optional[str],
    memory_limit: str,
    memory_horizon: float,
    memory_idle_wait: float,
    model: str,
    api_key: Optional[str],
    health: bool,
    cacert: Optional[str],
    metrics_port: Optional[int],
    metrics_host: Optional[str],
    log_format: Optional[str],
    state_file: Optional[str],
    command: Tuple[str, ...],
) -> None:
    """Run COMMAND (usually mlx_lm.server) and keep it serving.

    The child gets the hotfix shim and a heartbeat file; it is restarted when
    it exits (for any reason) or when the judge finds it wedged. A busy server
    is left alone. SIGTERM/SIGINT go to the child, then the supervisor exits 0.
    `mlx-watchdog restart NAME` restarts it on purpose: it drains first.

    Example: mlx-watchdog supervise -- mlx_lm.server --model M --port 8080
    """
    from .config import InstanceConfig, RestartConfig, name_from_url
    from .shim import with_shim
    from .supervise import Supervisor, SupervisorError, url_from_command

    setup_logging(log_format or defaults.LOG_FORMAT)
    try:
        env = dict(os.environ) if no_shim else with_shim()
    except FileNotFoundError as exc:
        raise click.ClickException(f"{exc} (run with --no-shim to go without it)") from None
    with tempfile.TemporaryDirectory(prefix="mlx-watchdog-") as private:
        # An mlx.launch group is supervised as one server (group.py).
        group_command = _group_command(command, env, private, remote_shim_path, no_shim)
        if group_command is not None:
            command = tuple(group_command.argv)
            if group_command.hosts and not group_command.hosts[0].local:
                listener_check = False  # rank 0 listens on another host, not in our tree
        if url is None:
            try:
                url = group_command.probe_url() if group_command else url_from_command(command)
            except ValueError as exc:
                raise click.UsageError(f"{exc}; pass --url") from None
        if group_command is None:
            _check_before_start(command, listener_check)
        metrics = _metrics(metrics_port, metrics_host)
        state = StateStore(state_file or default_state_path())
        name = name or name_from_url(url)
        # The same options as a `watch` instance; the supervisor restarts itself.
        instance = InstanceConfig(
            name=name,
            url=url,
            restart=RestartConfig("none"),
            model=model,
            api_key=secret(api_key),
            interval=probe_interval,
            timeout=probe_timeout,
            failures=failures,
            boot_grace=boot_grace,
            health_check=health,
            heartbeat_timeout=heartbeat_timeout,
            max_busy=max_busy,
            cpu_busy=cpu_busy,
            cacert=cacert,
            max_restarts=max_restarts,
            restart_window=restart_window,
            backoff_max=backoff_max,
            stop_grace=stop_grace,
            report_dir=report_dir,
            memory_limit=memory_limit,
            memory_horizon=memory_horizon,
            memory_idle_wait=memory_idle_wait,
        )
        listen_socket, socket_note = _held_socket(command, hold_socket, no_shim, group_command)
        supervisor = Supervisor(
            command,
            instance,
            env=env,
            heartbeat_file=Path(private) / "heartbeat.json",
            shim=not no_shim,
            listener_check=listener_check,
            listen_socket=listen_socket,
            control=control_dir(state.path),
            metrics=metrics,
            state=state,
        )
        from .redact import redact_argv, redact_url

        supervisor.events.info("supervise", f"supervising `{shlex.join(redact_argv(list(command)))}`"
                                            f", probing {redact_url(url)}")
        if socket_note:
            supervisor.events.info("socket", socket_note)
        if backoff_reset is not None:
            from .config import RETIRED

            supervisor.events.warning("option", f"--backoff-reset: {RETIRED['backoff_reset']}")
        try:
            code = supervisor.run()
        except SupervisorError as exc:
            raise click.ClickException(str(exc)) from None
    raise SystemExit(code)


@click.command("watch")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="TOML file listing the instances to watch and how to restart each.")
@click.option("--check", is_flag=True, help="Validate the config file and exit.")
@_daemon_options
def watch_command(
    config_path: str,
    check: bool,
    metrics_port: Optional[int],
    metrics_host: Optional[str],
    log_format: Optional[str],
    state_file: Optional[str],
) -> None:
    """Watch servers run by launchd, systemd or anything else, and restart
    the wedged ones with launchctl, systemctl, a signal or a command.

    Options given here override the config file's global keys.
    """
    from .config import ConfigError, load_config
    from .watch import Watcher, build_watched_server_monitor

    try:
        config = load_config(config_path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    names = [i.name for i in config.instances]
    if check:
        for warning in config.warnings:
            click.echo(f"warning: {warning}", err=True)
        click.echo(f"{config_path}: OK, {len(names)} instance(s): {', '.join(names)}")
        return
    setup_logging(log_format or config.log_format)
    for warning in config.warnings:
        Events().warning("config", warning)
    metrics = _metrics(metrics_port or config.metrics_port, metrics_host or config.metrics_host)
    state = StateStore(state_file or config.state_file or default_state_path())
    monitors = {i.name: build_watched_server_monitor(i, metrics=metrics, state=state)
                for i in config.instances}
    Events().info("watch", f"watching {len(names)} instance(s): {', '.join(names)}")
    intervals = {i.name: i.interval for i in config.instances}
    raise SystemExit(Watcher(monitors, intervals, control=control_dir(state.path)).run())


def _check_before_start(command: Tuple[str, ...], listener_check: bool) -> None:
    """install's checks of a server's flags, before the first start: a model
    path that does not exist, or a port another process holds, would only
    make the server die at every start, forever. (Skipped for the port with
    --no-listener-check: then the port may well be held by something that
    forwards to the child.)"""
    from .install.hostcheck import check_port_free, looks_like_local_path, resolve_model
    from .install.instance import FlagError
    from .urls import bind_host, flag_value

    model = flag_value(command, "--model")
    try:
        if model is not None and looks_like_local_path(model):
            resolve_model(model)
        port = flag_value(command, "--port")
        if listener_check and port is not None and port.isdigit():
            check_port_free(bind_host(command), int(port))
    except FlagError as exc:
        fix = {"--model": "give the server a model folder that exists",
               "--port": "stop what holds the port, or give the server another --port",
               "--host": "give the server a --host of this machine"}.get(exc.flag, "")
        raise click.ClickException(
            f"cannot start the server: {exc.flag} {exc.message}; it would die at every start"
            + (f" ({fix})" if fix else "")) from None


def _check_name(name: Optional[str]) -> Optional[str]:
    from .config import name_problem
    from .redact import printable

    if name is not None and name_problem(name):
        raise click.BadParameter(f"'{printable(name)}': {name_problem(name)}")
    return name


def _held_socket(command, wanted: bool, no_shim: bool, group_command):
    """The listening socket supervise holds for its children, or None, and
    the line that says so (logged after the line naming the command)."""
    from . import held_socket
    from .urls import bind_host, url_from_command

    if not wanted:
        return None, None
    if no_shim:
        return None, ("no held socket: without the shim the server cannot take one (it binds "
                      "its port itself)")
    if group_command is not None:
        return None, ("no held socket: rank 0 of an mlx.launch group binds its port itself "
                      "(the launcher starts the ranks)")
    from urllib.parse import urlsplit

    try:
        port = urlsplit(url_from_command(command)).port
    except ValueError:
        port = None
    if port is None:
        return None, ("no held socket: the server's port cannot be read from its command (it "
                      "binds its port itself)")
    host = bind_host(command)
    try:
        sock = held_socket.bind(host, port)
    except OSError as exc:
        shown = f"[{host}]" if ":" in host else host
        raise click.ClickException(
            f"cannot listen on {shown}:{port} for the server: {exc.strerror or exc} (is another "
            "server on that port? --no-socket lets each server bind it itself)") from None
    return sock, (f"holding {held_socket.describe(sock)} for the server: connections wait "
                  "there while it restarts")


def _group_command(command, env, private, remote_shim_path, no_shim):
    """The mlx.launch group command as it should run, or None for a lone server."""
    from .group import prepare
    from .group_hosts import GroupError

    try:
        return prepare(command, env, private_dir=private, remote_shim_path=remote_shim_path,
                       shim=not no_shim)
    except GroupError as exc:
        raise click.UsageError(str(exc)) from None


def _metrics(port: Optional[int], host: Optional[str]) -> Metrics:
    metrics = Metrics()
    if port:
        host = host or defaults.METRICS_HOST
        try:
            metrics.serve(port, host)
        except OSError as exc:
            shown = f"[{host}]" if ":" in host else host
            raise click.ClickException(
                f"cannot serve metrics on {shown}:{port}: {exc.strerror or exc}"
            ) from None
    return metrics
