"""The `mlx-watchdog` command line.

Each family of commands lives in its own module, imported only when that
command runs (or for its --help), so `mlx-watchdog probe`, run every few
seconds as a health check, loads click and the probe, not prometheus_client,
the installer or the daemon machinery (tests/test_cli_light.py checks). Bare
`mlx-watchdog --help` imports every command module to list their help.
"""

from __future__ import annotations

import os
import sys

import click

from . import __version__


# Each command: (module, attribute), imported on demand (click's LazyGroup pattern).
_LAZY = {
    "probe": ("probe_cli", "probe_command"),
    "supervise": ("daemon_cli", "supervise_command"),
    "watch": ("daemon_cli", "watch_command"),
    "status": ("status_cli", "status_command"),
    "restart": ("restart_cli", "restart_command"),
    "install": ("install.cli", "install_command"),
    "uninstall": ("install.cli", "uninstall_command"),
    "reports": ("reports_cli", "reports_command"),
    "doctor": ("doctor", "doctor_command"),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list:
        return sorted(set(super().list_commands(ctx)) | set(_LAZY))

    def get_command(self, ctx: click.Context, name: str):
        if name in _LAZY:
            import importlib

            module, attribute = _LAZY[name]
            return getattr(importlib.import_module(f"{__package__}.{module}"), attribute)
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mlx-watchdog")
def main() -> None:
    """Keep mlx_lm.server serving: hotfix shim, probes, judge and restarts."""


@main.command("shim-path")
def shim_path_command() -> None:
    """Print the folder to put first on PYTHONPATH to enable the hotfix shim.

    Example: PYTHONPATH="$(mlx-watchdog shim-path)" mlx_lm.server --model M
    """
    from .shim import shim_dir

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
    from .shim import with_shim

    env = with_shim()
    from .group_hosts import GroupError
    from .group_launch import is_launch_command

    if is_launch_command(command):
        # A group cannot be exec'd: mlx.launch exits 0 after a rank dies (group.py).
        from .group import prepare, run_group
        import tempfile

        with tempfile.TemporaryDirectory(prefix="mlx-watchdog-") as private:
            try:
                group = prepare(command, env, private_dir=private)
            except GroupError as exc:
                raise click.UsageError(str(exc)) from None
            sys.exit(run_group(group.argv, env))
    try:
        os.execvpe(command[0], list(command), env)
    except OSError as exc:
        raise click.ClickException(f"cannot run {command[0]!r}: {exc.strerror}") from exc


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
