"""`mlx-watchdog probe`: light on purpose.

It runs every few seconds as an exec health check, so it imports only click,
the probe and the defaults: no prometheus_client, installer or daemon modules
(tests/test_cli_light.py checks; bench/probe_startup.py measures).
"""

from __future__ import annotations

import json
import math
from typing import Callable, Optional

import click

from . import defaults
from .probe import OK, UNHEALTHY, UNREACHABLE, Probe, check_url, make_tls_context

class _FiniteFloat(click.FloatRange):
    """A FloatRange that refuses nan (it passes every bound) and inf."""

    name = "float"

    def convert(self, value, param, ctx):  # type: ignore[override]
        number = super().convert(value, param, ctx)
        if not math.isfinite(number) or number > 1e7:
            self.fail(f"{value!r} is not a finite number of at most 1e7", param, ctx)
        return number


_SECONDS = _FiniteFloat(min=0, min_open=True)
_SECONDS_OR_ZERO = _FiniteFloat(min=0)
_EXIT_CODES = {OK: 0, UNHEALTHY: 1, UNREACHABLE: 2}


def _api_key_option(f: Callable) -> Callable:
    return click.option(
        "--api-key",
        envvar=defaults.API_KEY_ENV,
        show_envvar=True,
        default=None,
        help="Sent as 'Authorization: Bearer KEY'. Never logged or stored, and "
        "whitespace around it is dropped. A key given as a flag shows in `ps` to every "
        f"local user: prefer the {defaults.API_KEY_ENV} variable (or api_key_env in a "
        "config file).",
    )(f)


def _check_url(ctx: click.Context, param: click.Parameter, value: Optional[str]):
    if value is None:
        return None
    try:
        return check_url(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


def _check_cacert(ctx: click.Context, param: click.Parameter, value: Optional[str]):
    if value is None:
        return None
    try:
        make_tls_context(value)
    except OSError as exc:
        raise click.BadParameter(f"{value}: {exc.strerror or exc}", ctx=ctx, param=param) from None
    except Exception as exc:  # noqa: BLE001 - ssl.SSLError: not PEM certificates
        raise click.BadParameter(
            f"{value}: not a PEM file of CA certificates ({exc})", ctx=ctx, param=param
        ) from None
    return value


def _cacert_option(f: Callable) -> Callable:
    return click.option(
        "--cacert",
        type=click.Path(dir_okay=False),
        default=None,
        callback=_check_cacert,
        help="https: trust the CA certificates in this PEM file (instead of the system's "
        "trust store, which honours SSL_CERT_FILE and SSL_CERT_DIR).",
    )(f)


def _health_option(f: Callable) -> Callable:
    return click.option(
        "--health/--no-health",
        default=defaults.CHECK_HEALTH,
        show_default=True,
        help="GET /health first; a 503 there means the generation thread is gone.",
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
@click.option(
    "--url",
    default=defaults.URL,
    show_default=True,
    callback=_check_url,
    help="The server's base URL.",
)
@click.option(
    "--timeout",
    type=_SECONDS,
    default=defaults.PROBE_TIMEOUT_S,
    show_default=True,
    help="Seconds for the whole probe, /health and completion together.",
)
@_model_option
@_api_key_option
@_health_option
@_cacert_option
@click.pass_context
def probe_command(
    ctx: click.Context,
    url: str,
    timeout: float,
    model: str,
    api_key: Optional[str],
    health: bool,
    cacert: Optional[str],
) -> None:
    """Send one real one-token completion and print the result as JSON.

    Exit status: 0 healthy, 1 unhealthy (timeout, error, no tokens, dead
    generation thread), 2 unreachable (nothing listening). Usable as a
    Kubernetes, Docker or Consul exec health check.
    """
    result = Probe(
        url, timeout=timeout, model=model, api_key=api_key, check_health=health, cacert=cacert
    )()
    fields = ("status", "latency_s", "tokens", "reason")
    line = {k: getattr(result, k) for k in fields}
    if result.warning:  # a known-bad install: the server said so on /health
        line["warning"] = result.warning
        click.echo(f"WARNING: {result.warning}", err=True)
    click.echo(json.dumps(line))
    ctx.exit(_EXIT_CODES[result.status])
