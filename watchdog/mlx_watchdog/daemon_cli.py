"""probe, supervise, watch and status: the watchdog's commands."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional, Tuple

import click

from . import defaults
from .log import FORMATS, Events, setup_logging
from .metrics import Metrics
from .probe import OK, UNHEALTHY, UNREACHABLE, Probe
from .state import StateStore, default_state_path, format_status, read_state

_SECONDS = click.FloatRange(min=0, min_open=True)
_SECONDS_OR_ZERO = click.FloatRange(min=0)
_EXIT_CODES = {OK: 0, UNHEALTHY: 1, UNREACHABLE: 2}


def _api_key_option(f: Callable) -> Callable:
    return click.option(
        "--api-key",
        envvar=defaults.API_KEY_ENV,
        show_envvar=True,
        default=None,
        help="Sent as 'Authorization: Bearer KEY'. Never logged or stored.",
    )(f)


def _model_option(f: Callable) -> Callable:
    return click.option(
        "--model",
        default=defaults.MODEL,
        show_default=True,
        help="The model name the probe asks for. Use what your clients send: in "
        "mlx-lm a request for another model reloads the model.",
    )(f)


def _state_file_option(f: Callable) -> Callable:
    return click.option(
        "--state-file",
        type=click.Path(dir_okay=False),
        default=None,
        help="The JSON state file. [default: $XDG_STATE_HOME/mlx-watchdog/state.json, "
        "or ~/.local/state/mlx-watchdog/state.json]",
    )(f)


def _number_option(
    flag: str, default: float, text: str, kind: click.ParamType = _SECONDS
) -> Callable:
    return click.option(flag, type=kind, default=default, show_default=True, help=text)


def _daemon_options(f: Callable) -> Callable:
    f = _state_file_option(f)
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


@click.command("probe")
@click.option("--url", default=defaults.URL, show_default=True, help="The server's base URL.")
@click.option(
    "--timeout",
    type=_SECONDS,
    default=defaults.PROBE_TIMEOUT_S,
    show_default=True,
    help="Seconds for the whole probe, /health and completion together.",
)
@_model_option
@_api_key_option
@click.option(
    "--health/--no-health",
    default=defaults.CHECK_HEALTH,
    show_default=True,
    help="GET /health first; a 503 there means the generation thread is gone.",
)
@click.pass_context
def probe_command(
    ctx: click.Context, url: str, timeout: float, model: str, api_key: Optional[str], health: bool
) -> None:
    """Send one real one-token completion and print the result as JSON.

    Exit status: 0 healthy, 1 unhealthy (timeout, error, no tokens, dead
    generation thread), 2 unreachable (nothing listening). Usable as a
    Kubernetes, Docker or Consul exec health check.
    """
    result = Probe(url, timeout=timeout, model=model, api_key=api_key, check_health=health)()
    fields = ("status", "latency_s", "tokens", "reason")
    click.echo(json.dumps({k: getattr(result, k) for k in fields}))
    ctx.exit(_EXIT_CODES[result.status])


@click.command(
    "supervise",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option(
    "--url",
    default=None,
    help=f"Where to probe. [default: from the command's --host/--port, else {defaults.URL}]",
)
@click.option(
    "--name", default=None, help="Instance name in logs, metrics and status. [default: host:port]"
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
    "--stop-grace",
    defaults.STOP_GRACE_S,
    "Seconds between SIGTERM and SIGKILL.",
    kind=_SECONDS_OR_ZERO,
)
@_number_option(
    "--max-restarts",
    defaults.MAX_RESTARTS,
    "Restarts allowed per --restart-window; more is a crash loop and restarts pause.",
    kind=click.IntRange(min=1),
)
@_number_option("--restart-window", defaults.RESTART_WINDOW_S, "Seconds, see --max-restarts.")
@click.option(
    "--no-shim",
    is_flag=True,
    help="Do not put the hotfix shim on the child's PYTHONPATH (no clean exit on a dead "
    "generation thread, no heartbeat).",
)
@_model_option
@_api_key_option
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
    stop_grace: float,
    max_restarts: int,
    restart_window: float,
    no_shim: bool,
    model: str,
    api_key: Optional[str],
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

    Example: mlx-watchdog supervise -- mlx_lm.server --model M --port 8080
    """
    from .act import RestartPolicy
    from .judge import JudgeConfig
    from .shim import with_shim
    from .supervise import Supervisor, SupervisorError, url_from_command

    setup_logging(log_format or defaults.LOG_FORMAT)
    if url is None:
        try:
            url = url_from_command(command)
        except ValueError as exc:
            raise click.UsageError(f"{exc}; pass --url") from None
    try:
        env = dict(os.environ) if no_shim else with_shim()
    except FileNotFoundError as exc:
        raise click.ClickException(f"{exc} (run with --no-shim to go without it)") from None
    metrics = _metrics(metrics_port, metrics_host)
    state = StateStore(state_file or default_state_path())
    name = name or url.split("://", 1)[-1].split("/", 1)[0].rsplit("@", 1)[-1]
    with tempfile.TemporaryDirectory(prefix="mlx-watchdog-") as private:
        supervisor = Supervisor(
            command,
            probe=Probe(url, timeout=probe_timeout, model=model, api_key=api_key),
            name=name,
            url=url,
            env=env,
            heartbeat_file=Path(private) / "heartbeat.json",
            shim=not no_shim,
            judge_config=JudgeConfig(
                failures=failures, max_busy_s=max_busy, heartbeat_timeout_s=heartbeat_timeout
            ),
            policy=RestartPolicy(
                boot_grace_s=boot_grace, max_restarts=max_restarts, window_s=restart_window
            ),
            interval_s=probe_interval,
            stop_grace_s=stop_grace,
            metrics=metrics,
            state=state,
        )
        supervisor.events.info("supervise", f"supervising {command[0]}, probing {url}")
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
    from .watch import Watcher, build_monitor

    try:
        config = load_config(config_path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    names = [i.name for i in config.instances]
    if check:
        click.echo(f"{config_path}: OK, {len(names)} instance(s): {', '.join(names)}")
        return
    setup_logging(log_format or config.log_format)
    metrics = _metrics(metrics_port or config.metrics_port, metrics_host or config.metrics_host)
    state = StateStore(state_file or config.state_file or default_state_path())
    monitors = {i.name: build_monitor(i, metrics=metrics, state=state) for i in config.instances}
    Events().info("watch", f"watching {len(names)} instance(s): {', '.join(names)}")
    raise SystemExit(Watcher(monitors, {i.name: i.interval for i in config.instances}).run())


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print the state file as JSON.")
@_state_file_option
@click.pass_context
def status_command(ctx: click.Context, as_json: bool, state_file: Optional[str]) -> None:
    """Show what the running watchdog last saw of each instance."""
    path = state_file or default_state_path()
    try:
        data = read_state(path)
    except FileNotFoundError:
        click.echo(
            f"no state file at {path}: is `mlx-watchdog supervise` or `watch` running "
            "(with this --state-file)?",
            err=True,
        )
        ctx.exit(1)
    except (OSError, ValueError) as exc:
        click.echo(f"cannot read {path}: {exc}", err=True)
        ctx.exit(1)
    click.echo(json.dumps(data, indent=2, sort_keys=True) if as_json else format_status(data))


def _metrics(port: Optional[int], host: Optional[str]) -> Metrics:
    metrics = Metrics()
    if port:
        try:
            metrics.serve(port, host or defaults.METRICS_HOST)
        except OSError as exc:
            raise click.ClickException(
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}"
            ) from None
    return metrics
