"""`mlx-watchdog reports`: the crash reports the shim and the watchdog wrote."""

from __future__ import annotations

import json
from typing import Optional

import click

from .redact import printable
from .reports import (
    UNREADABLE,
    find_report,
    format_markdown,
    format_table,
    load_reports,
    matches_instance,
    report_dir,
)

_DIR_HELP = ("The report folder. [default: $MLX_HOTFIX_REPORT_DIR, "
             "~/Library/Logs/mlx-watchdog/reports on macOS, "
             "$XDG_STATE_HOME/mlx-watchdog/reports elsewhere]")


@click.group("reports", invoke_without_command=True)
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None, help=_DIR_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print every report as a JSON list.")
@click.option("--markdown", is_flag=True, help="Print the newest report as Markdown, ready to "
              "paste into an upstream issue (no prompts, no keys).")
@click.option("--instance", default=None, metavar="NAME",
              help="Only the reports of this instance (its name as in `status`, or its port).")
@click.pass_context
def reports_command(ctx: click.Context, directory: Optional[str], as_json: bool,
                    markdown: bool, instance: Optional[str]) -> None:
    """List crash reports, newest first, with the instance each one is about
    (see `reports show ID`)."""
    ctx.obj = report_dir(directory)
    if ctx.invoked_subcommand is not None:
        return
    reports = load_reports(ctx.obj)
    if instance is not None:
        reports = [r for r in reports if matches_instance(r, instance)]
    if as_json:
        click.echo(json.dumps(reports, indent=1, sort_keys=True))
    elif markdown:
        readable = [r for r in reports if not r.get(UNREADABLE)]
        if not readable:
            raise click.ClickException(f"no readable reports in {ctx.obj}")
        click.echo(format_markdown(readable[0]), nl=False)
    else:
        where = f"{ctx.obj}" + (f" for instance {instance}" if instance is not None else "")
        click.echo(format_table(reports) if reports else f"no reports in {where}")


@reports_command.command("show")
@click.argument("report_id")
@click.option("--markdown", is_flag=True, help="Markdown for an upstream issue.")
@click.pass_obj
def show_command(directory, report_id: str, markdown: bool) -> None:
    """Print one report: by ID, a unique ID prefix, or its # in the list."""
    report = find_report(directory, report_id)
    if report is None:
        raise click.ClickException(f"no report {report_id!r} in {directory} "
                                   "(see `mlx-watchdog reports`)")
    if markdown and report.get(UNREADABLE):
        raise click.ClickException(
            printable(f"unreadable report {report['id']}: {report[UNREADABLE]}"))
    click.echo(format_markdown(report) if markdown else json.dumps(report, indent=1,
                                                                     sort_keys=True),
               nl=not markdown)
