"""The `mlx-watchdog` command line.

Each family of commands lives in its own module and is attached here, so that
`mlx-watchdog probe` does not pay for importing the installer, and so on.
"""

from __future__ import annotations

import os
import sys

import click

from . import __version__
from .shim import shim_dir, with_shim


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mlx-watchdog")
def main() -> None:
    """Keep mlx_lm.server serving: hotfix shim, probes, judge and restarts."""


@main.command("shim-path")
def shim_path_command() -> None:
    """Print the folder to put first on PYTHONPATH to enable the hotfix shim.

    Example: PYTHONPATH="$(mlx-watchdog shim-path)" mlx_lm.server --model M
    """
    click.echo(str(shim_dir()))


@main.command(
    "exec",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_command(command: tuple) -> None:
    """Run COMMAND with the hotfix shim on its PYTHONPATH (replaces this process).

    Example: mlx-watchdog exec -- mlx_lm.server --model M
    """
    env = with_shim()
    try:
        os.execvpe(command[0], list(command), env)
    except OSError as exc:
        raise click.ClickException(f"cannot run {command[0]!r}: {exc.strerror}") from exc


def _attach_commands() -> None:
    from .daemon_cli import probe_command, status_command, supervise_command, watch_command
    from .install_cli import install_command, uninstall_command

    for command in (probe_command, supervise_command, watch_command, status_command,
                    install_command, uninstall_command):
        main.add_command(command)
    from .doctor import doctor_command

    main.add_command(doctor_command)


_attach_commands()


if __name__ == "__main__":  # pragma: no cover
    # Run as `python -m mlx_watchdog.cli`: the commands registered themselves on
    # the imported module's group, not on this __main__ copy.
    from mlx_watchdog.cli import main as registered_main

    sys.exit(registered_main())
