"""Carry out a Plan (write the files, then load them) and uninstall one
instance (unload, then remove what install wrote, the manifest last).

Side effects: files in the layout's folders, and the manager's commands
through a commands.Runner (only shown in a dry run).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import List, Optional

import click

from ..safefile import write_atomically
from .backend import backend_for, default_layout
from .commands import Runner
from .instance import FlagError, InstallError, check_name, default_name, manifest_path
from .manifest import Manifest, installed_names, is_ours
from .plan import Plan


def write_file(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write atomically (temp file + rename) so a unit is never half-written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, data, mode=mode)


def apply(plan: Plan) -> None:
    inst, backend = plan.inst, plan.backend
    files = backend.render(inst)
    allowed = set(plan.existing.files) if plan.existing else set()
    for path in files:
        if path.exists() and str(path) not in allowed and not is_ours(path):
            raise InstallError(
                f"refusing to overwrite {path}: it was not written by mlx-watchdog "
                "(choose another --name)")

    services = backend.service_names(inst.name)
    manifest = Manifest(
        manager=inst.manager, name=inst.name, system=inst.system, host=inst.host,
        port=inst.port, files=[str(p) for p in files] + [str(inst.manifest_path)],
        services=services, dry_run=plan.dry_run,
    )
    try:
        for path, data in files.items():
            write_file(path, data)
        write_file(inst.manifest_path, manifest.to_json().encode())
        if not plan.dry_run and not inst.system:
            # launchd does not create the folders of StandardOutPath; the
            # shim and the watchdog write into state_dir.
            for folder in (inst.layout.state_dir, inst.layout.log_dir):
                if folder is not None:
                    folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InstallError(f"cannot write {exc.filename or ''}: {exc.strerror}"
                           + (" (use --output-dir, or run as root)" if inst.system else "")
                           ) from None

    for path in files:
        click.echo(f"wrote {path}")
    click.echo(f"wrote {inst.manifest_path}")

    failure_hint = (
        f"The files are in place in {inst.layout.unit_dir}; fix the problem and re-run "
        f"install, or remove them with `mlx-watchdog uninstall {inst.manager} --name {inst.name}"
        + (" --system" if inst.system else "")
        + (f" --output-dir {shlex.quote(str(inst.layout.unit_dir))}" if plan.custom_dir else "")
        + "`."
    )
    try:
        backend.load(plan, Runner(dry_run=plan.dry_run))
    except InstallError as exc:
        raise InstallError(f"{exc}\n{failure_hint}") from exc

    notes = backend.installed_notes(inst) + [
        f"check it: mlx-watchdog status   (state in {inst.state_file})"]
    if inst.metrics_port is not None:
        host = inst.metrics_host or "127.0.0.1"
        notes.append(f"metrics: http://{'[' + host + ']' if ':' in host else host}:"
                     f"{inst.metrics_port}/metrics")
    if plan.dry_run:
        click.echo("dry run: nothing was loaded. Once installed:")
        for note in notes:
            click.echo(f"  {note}")
        return
    click.echo(f"installed {inst.name}: {' + '.join(services)}; server at {inst.url}")
    for note in notes:
        click.echo(note)


def uninstall(manager: str, *, name: Optional[str], port: Optional[int], system: bool,
              output_dir: Optional[Path], dry_run: bool) -> None:
    backend = backend_for(manager)
    if system and not backend.supports_system:
        raise FlagError("--system", "is for systemd only")
    layout = default_layout(manager, home=Path.home(), system=system, environ=os.environ,
                            output_dir=output_dir)
    if name is None and port is not None:
        name = default_name(port)
    if name is None:
        names = installed_names(layout)
        if len(names) != 1:
            found = f"installed: {', '.join(names)}" if names else \
                f"no install manifest in {layout.config_dir}"
            raise FlagError("--name", f"required ({found})")
        name = names[0]
    name = check_name(name)
    manifest = Manifest.load(manifest_path(layout, name))
    foreign_manifest = manifest is not None and manifest.manager != manager
    if foreign_manifest:  # a shared --output-dir: that config belongs to the other manager
        manifest = None

    definitions = backend.definition_paths(layout.unit_dir, name)
    candidates = list(definitions)
    if not foreign_manifest:
        candidates += [layout.config_dir / f"{name}.toml", manifest_path(layout, name)]
    listed = set(manifest.files) if manifest else set()
    to_remove: List[Path] = []
    kept: List[Path] = []
    for path in candidates:
        if path.exists() or path.is_symlink():
            (to_remove if (str(path) in listed or is_ours(path)) else kept).append(path)
    removes_definitions = any(p in to_remove for p in definitions)

    runner = Runner(dry_run=dry_run)
    uid = os.getuid() if hasattr(os, "getuid") else 0
    backend.unload(name, system=system, uid=uid, runner=runner,
                   definitions_present=removes_definitions)

    # The manifest goes last, so an interrupted uninstall can be re-run.
    for path in to_remove:
        if dry_run:
            click.echo(f"would remove: {path}")
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise InstallError(f"cannot remove {path}: {exc.strerror}") from exc
        click.echo(f"removed {path}")
    for path in kept:
        click.echo(f"warning: kept {path}: not written by mlx-watchdog install", err=True)

    if removes_definitions:
        backend.after_removal(system=system, runner=runner)
    if not to_remove and not dry_run:
        click.echo(f"nothing installed for {name} in {layout.unit_dir}")
    elif not dry_run:
        click.echo(f"uninstalled {name}")
