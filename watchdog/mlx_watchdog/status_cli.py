"""`mlx-watchdog status`: what the running watchdogs last saw of each instance."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable, Optional

import click

from . import defaults
from .log import colour_wanted
from .redact import printable, scrub, secret
from .state import (SERVING_STATES, STALE, STOPPED, known_state_files, prune_state, read_states,
                    status_of)
from .status_view import format_status


def state_file_option(f: Callable) -> Callable:
    return click.option(
        "--state-file",
        type=click.Path(dir_okay=False),
        default=None,
        help="The JSON state file. [default: $XDG_STATE_HOME/mlx-watchdog/state.json, "
        "or ~/.local/state/mlx-watchdog/state.json]",
    )(f)



@click.command("status")
@click.option("--json", "as_json", is_flag=True,
              help="Print the instances as JSON (each with its shown state as \"status\").")
@click.option("--prune", is_flag=True,
              help="Forget every instance whose watchdog stopped or is gone (stale), then show "
              "the rest.")
@click.option("--no-color", "no_color", is_flag=True,
              help="No colour even on a terminal (so does a set NO_COLOR variable).")
@state_file_option
@click.pass_context
def status_command(ctx: click.Context, as_json: bool, prune: bool, no_color: bool,
                   state_file: Optional[str]) -> None:
    """Show what the running watchdogs last saw of each instance.

    Without --state-file it reads the shared state file and every installed
    instance's NAME.state.json (in each service manager's state folder). A
    row whose watchdog is gone, or silent for three intervals, reads "stale
    (watchdog not running)"; one whose watchdog stopped cleanly, "stopped".
    Exits 0 when every instance is healthy or busy, 1 otherwise (like
    `systemctl is-active`) and when there is nothing to show.
    """
    secret(os.environ.get(defaults.API_KEY_ENV))  # known, so scrubbed from the output
    paths = [Path(state_file)] if state_file else known_state_files()
    now = time.time()
    if prune:
        for path in paths:
            try:
                forgotten = prune_state(
                    path, lambda record: status_of(record, now) in (STALE, STOPPED))
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as exc:
                click.echo(f"cannot prune {path}: {exc}", err=True)
                continue
            for name in forgotten:
                click.echo(f"forgot {printable(name)} ({path})", err=True)
    instances: dict = {}
    found = []
    for path, data in read_states(paths):
        found.append(path)
        for name, record in data["instances"].items():
            key = name if name not in instances else f"{name} ({path})"
            instances[key] = record
    if not found:
        if state_file:
            message = (f"no state file at {paths[0]}: is `mlx-watchdog supervise` or `watch` "
                       "running (with this --state-file)?")
        else:
            folders = sorted({str(p.parent) for p in paths[1:]})
            message = (f"no state file at {paths[0]}, nor an installed instance's in "
                       f"{', '.join(folders)}: is `mlx-watchdog supervise`, `watch` or an "
                       "installed instance running?")
        click.echo(message, err=True)
        ctx.exit(1)
    shown = {name: status_of(record, now) for name, record in instances.items()}
    if as_json:
        out = {name: dict(record, status=shown[name]) if isinstance(record, dict) else record
               for name, record in instances.items()}
        click.echo(scrub(json.dumps({"instances": out, "files": [str(p) for p in found]},
                                    indent=2, sort_keys=True)))
    else:
        colour = colour_wanted(no_color)
        click.echo(format_status({"instances": instances}, now=now, colour=colour))
    ctx.exit(0 if shown and all(state in SERVING_STATES for state in shown.values()) else 1)
