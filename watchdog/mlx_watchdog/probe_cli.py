"""`mlx-watchdog probe`: light on purpose.

It runs every few seconds as an exec health check, so it imports only click,
the probe and the defaults: no prometheus_client, installer or daemon modules
(tests/test_cli_light.py checks; bench/probe_startup.py measures).
"""

from __future__ import annotations

import json
from typing import Callable, Optional

import click

from . import defaults
from .probe import OK, UNHEALTHY, UNREACHABLE, Probe

_SECONDS = click.FloatRange(min=0, min_open=True)
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
