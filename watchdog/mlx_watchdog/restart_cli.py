"""`mlx-watchdog restart NAME`: a planned restart of a running instance.

The request goes to the daemon that runs NAME (a `watch` instance, or the
child of a `supervise --name NAME`) through its control folder (control.py);
the daemon's monitor restarts it between two ticks: SIGTERM, the shim's drain
(the accepted requests finish), then the normal stop, and the server comes
back on the same held socket. Then, unless --no-wait, this waits until the
daemon's probe finds the new server serving.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Dict, Optional

import click

from .probe_cli import _SECONDS
from .state import known_state_files, read_state, read_states

CLAIM_WAIT_S = 10.0  # a running daemon takes a request within half a second


def _daemon_running(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's: it exists
    return True


def _record(path: Path, name: str) -> Dict[str, Any]:
    try:
        instances = read_state(path)["instances"]
    except FileNotFoundError:
        raise click.ClickException(
            f"no state file at {path}: is `mlx-watchdog supervise` or `watch` running (with "
            "this --state-file)?") from None
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot read {path}: {exc}") from None
    record = instances.get(name)
    if not isinstance(record, dict):
        known = ", ".join(sorted(instances)) or "none"
        raise click.ClickException(f"no instance {name!r} in {path} (instances there: {known})")
    return record


def _state_file_of(name: str) -> Path:
    """The state file that has instance NAME, looked for where `status` looks:
    the shared state file and every installed instance's NAME.state.json. Of
    several, the one whose daemon runs; two running ones: ask for --state-file."""
    paths = known_state_files()
    having, known = [], set()
    for path, data in read_states(paths):
        instances = data["instances"]
        known.update(instances)
        if isinstance(instances.get(name), dict):
            having.append((path, instances[name]))
    if not having:
        folders = ", ".join(dict.fromkeys(str(p.parent) for p in paths))
        raise click.ClickException(
            f"no instance {name!r} in any state file (looked in {folders}; instances there: "
            f"{', '.join(sorted(known)) or 'none'}); is it running? Name its daemon's "
            "--state-file if it has one elsewhere")
    running = [path for path, record in having if _daemon_running(record.get("daemon_pid"))]
    if len(running) > 1:
        raise click.ClickException(
            f"instance {name!r} is in several running daemons' state files "
            f"({', '.join(map(str, running))}): choose one with --state-file")
    return running[0] if running else having[0][0]


def _wait(condition, timeout: float, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


@click.command("restart")
@click.argument("name")
@click.option("--state-file", type=click.Path(dir_okay=False), default=None,
              help="The state file of the daemon that runs NAME. [default: "
                   "the one that has NAME, of the files `status` reads: "
                   "$XDG_STATE_HOME/mlx-watchdog/state.json (or "
                   "~/.local/state/mlx-watchdog/state.json) and every installed instance's "
                   "NAME.state.json]")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Wait until the restarted server serves again (a good probe).")
@click.option("--timeout", type=_SECONDS, default=600.0, show_default=True,
              help="Seconds to wait in all: the drain, the stop, and (with --wait) the "
                   "model load.")
def restart_command(name: str, state_file: Optional[str], wait: bool, timeout: float) -> None:
    """Restart instance NAME on purpose, without losing a request.

    NAME is an instance of a running `mlx-watchdog watch`, or the --name of a
    `supervise`. The server drains (its accepted requests finish, new ones wait
    in the held socket or get 503 with Retry-After), stops and starts again.
    It is logged and counted apart from restarts for a wedge
    (mlx_watchdog_restarts_total{reason="planned"}).

    Example: mlx-watchdog restart mlx-8080
    """
    from .control import ControlError, Request, control_dir

    path = Path(state_file) if state_file else _state_file_of(name)
    record = _record(path, name)
    daemon = record.get("daemon_pid")
    if not _daemon_running(daemon):
        raise click.ClickException(
            f"the daemon that ran {name!r} (pid {daemon}) is not running; start it first")
    began = time.time()
    user = os.environ.get("USER") or os.environ.get("LOGNAME") or f"uid {os.geteuid()}"
    try:
        request = Request(control_dir(path), name, f"asked by {user} (mlx-watchdog restart)")
    except ControlError as exc:
        raise click.ClickException(f"{exc} (is pid {daemon} a daemon of this version?)") from None
    except OSError as exc:
        raise click.ClickException(f"cannot write the request: {exc.strerror or exc}") from None
    if not _wait(request.taken, CLAIM_WAIT_S) and request.withdraw():
        raise click.ClickException(
            f"pid {daemon} did not take the request within {CLAIM_WAIT_S:g}s: is it an "
            "mlx-watchdog watch or supervise of this version, running with this state file?")
    click.echo(f"{name}: restarting (pid {daemon} drains the server, then starts it again)")
    deadline = time.monotonic() + timeout
    answer = _wait(lambda: request.answer() or (not _daemon_running(daemon) and {
        "ok": False, "detail": f"the daemon (pid {daemon}) stopped"}),
        max(0.0, deadline - time.monotonic()))
    if not answer:
        raise click.ClickException(f"{name}: no answer from pid {daemon} within {timeout:g}s")
    if not answer.get("ok"):
        raise click.ClickException(f"{name}: restart failed: {answer.get('detail')}")
    click.echo(f"{name}: restarted: {answer.get('detail')}")
    if not wait:
        return
    restarted_at = answer.get("time") if isinstance(answer.get("time"), (int, float)) else began

    def serving() -> bool:
        try:
            current = _record(path, name)
        except click.ClickException:
            return False
        ok = current.get("last_ok_probe")
        return isinstance(ok, (int, float)) and ok > restarted_at

    if not _wait(serving, max(0.0, deadline - time.monotonic()), interval=0.5):
        state = _record(path, name).get("state")
        raise click.ClickException(
            f"{name}: not serving again within {timeout:g}s (state: {state}); see "
            "`mlx-watchdog status`")
    click.echo(f"{name}: serving again, {time.time() - began:.1f}s after the request")
