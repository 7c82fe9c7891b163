"""Running launchctl/systemctl for install and uninstall: each command is
echoed (`$ ...`) and run, or in a dry run only shown (`would run: ...`).
A failure is an InstallError that names the command and its output."""

from __future__ import annotations

import shlex
import subprocess
from typing import Optional, Sequence

import click

from .instance import InstallError


class Runner:
    def __init__(self, *, dry_run: bool) -> None:
        self.dry_run = dry_run

    def show(self, argv: Sequence[str], note: Optional[str] = None) -> None:
        click.echo(f"would run: {shlex.join(argv)}" + (f"   # {note}" if note else ""))

    def step(self, argv: Sequence[str]) -> None:
        """Run argv (shown only, in a dry run); InstallError if it fails."""
        if self.dry_run:
            self.show(argv)
        else:
            self.run(argv)

    def succeeds(self, argv: Sequence[str]) -> bool:
        """Run a query quietly: did it exit 0?"""
        return self.run(argv, check=False, quiet=True).returncode == 0

    def run(self, argv: Sequence[str], *, check: bool = True,
            quiet: bool = False) -> "subprocess.CompletedProcess[str]":
        if not quiet:
            click.echo(f"$ {shlex.join(argv)}")
        try:
            proc = subprocess.run(list(argv), capture_output=True, text=True)
        except FileNotFoundError as exc:
            raise InstallError(f"{argv[0]}: command not found") from exc
        if check and proc.returncode != 0:
            detail = (proc.stderr or proc.stdout or "").strip()
            raise InstallError(f"`{shlex.join(argv)}` failed with exit status {proc.returncode}"
                               + (f": {detail}" if detail else ""))
        return proc
