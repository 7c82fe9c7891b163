"""`mlx-watchdog install` and `uninstall`: launchd agents or systemd units for
a stock mlx_lm.server (with the hotfix shim) and its watchdog.

The rendering is pure (launchd.py, systemd.py, services.py); this module
validates flags against the host, writes the files and runs launchctl or
systemctl.

`python -m mlx_watchdog.install_cli --write-reference [ROOT]` regenerates the
reference files in the repo's launchd/ and systemd/ folders;
`--check-reference [ROOT]` exits 1 if they drifted.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence, Tuple

import click

MANAGERS = ("launchd", "systemd")

_INSTALL_HELP = """Install MANAGER (launchd or systemd) definitions for a server and its watchdog.

\b
Writes, for instance NAME (default mlx-PORT):
  - a server definition running `PYTHON -m mlx_lm server --model MODEL
    --host HOST --port PORT [SERVER_ARGS...]` with the hotfix shim on its
    PYTHONPATH and MLX_HOTFIX_HEARTBEAT_FILE set;
  - a watchdog definition running `mlx_watchdog.cli watch --config NAME.toml`;
  - NAME.toml (the watchdog config) and NAME.install.json (what was written,
    for uninstall).
Then loads them: launchctl bootout (if loaded) + bootstrap gui/UID, or
systemctl [--user] daemon-reload + enable --now (enable + restart when
updating an existing install). Re-running install updates in place.

\b
launchd: ~/Library/LaunchAgents/io.github.mlx-watchdog.NAME.{server,watchdog}.plist,
  logs in ~/Library/Logs/mlx-watchdog/. The server has KeepAlive
  {SuccessfulExit: false, Crashed: true} (exit 70 restarts) and
  ThrottleInterval 30 (default 10): launchd's respawn throttle is its only
  storm control; it only delays a server that dies within 30 s of its launch
  (a crash loop), not one that ran for hours. ProcessType Interactive keeps the server out of
  background (App Nap-style) throttling.
systemd: ~/.config/systemd/user/NAME-{server,watchdog}.service (--system:
  /etc/systemd/system), logs in the journal. The server is Type=notify with
  WatchdogSec=60, TimeoutStartSec=600, Restart=on-failure, and at most 5
  starts in 10 minutes.

\b
Example (server flags after --):
  mlx-watchdog install systemd --model ~/models/qwen --port 8080 -- --max-tokens 4096
"""


def _flag_error(exc) -> click.BadParameter:
    return click.BadParameter(exc.message, param_hint=[exc.flag])


@click.command("install", help=_INSTALL_HELP,
               context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("manager", type=click.Choice(MANAGERS))
@click.option("--model", required=True,
              help="Model directory (must exist) or Hugging Face repo id (fetched by the server).")
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True,
              help="Server port; must be free on HOST.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Server bind address.")
@click.option("--name", default=None,
              help="Instance name, [A-Za-z0-9_.-]+ (default: mlx-PORT). One name per server.")
@click.option("--python", "python", default=None,
              help="Python whose stock mlx_lm runs the server (default: this Python).")
@click.option("--watchdog-python", default=None,
              help="Python with mlx_watchdog installed, for the watchdog (default: this Python).")
@click.option("--shim-dir", default=None,
              help="Hotfix drop-in folder for PYTHONPATH (default: `mlx-watchdog shim-path`).")
@click.option("--offline", is_flag=True, help="Set HF_HUB_OFFLINE=1 for the server.")
@click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write the definitions, config and manifest here instead of the standard "
                   "directories.")
@click.option("--dry-run", is_flag=True,
              help="Write the files, print the launchctl/systemctl commands, run nothing.")
@click.option("--system", is_flag=True,
              help="systemd only: a system service in /etc/systemd/system (needs root).")
@click.option("--user-name", default=None,
              help="systemd --system only: run the server as this user (User=).")
@click.option("--hostfile", default=None,
              help="A distributed group: mlx.launch's JSON hostfile (rank 0 first). Every "
                   "host must be reachable by ssh without a prompt, or be this machine.")
@click.option("--hosts", "group_hosts", default=None,
              help="A distributed group: mlx.launch --hosts, comma-separated.")
@click.option("--backend", default=None,
              help="A distributed group: mlx.launch --backend (ring, jaccl, mpi...).")
@click.option("--remote-shim-path", default=None,
              help="A distributed group: the hotfix shim folder on the other hosts "
                   "(default: the same path as --shim-dir).")
@click.argument("server_args", nargs=-1, type=click.UNPROCESSED)
def install_command(manager: str, model: str, port: int, host: str, name: Optional[str],
                    python: Optional[str], watchdog_python: Optional[str],
                    shim_dir: Optional[str], offline: bool, output_dir: Optional[Path],
                    dry_run: bool, system: bool, user_name: Optional[str],
                    hostfile: Optional[str], group_hosts: Optional[str],
                    backend: Optional[str], remote_shim_path: Optional[str],
                    server_args: Tuple[str, ...]) -> None:
    from . import services as sv

    try:
        plan = _prepare_install(
            manager=manager, model=model, port=port, host=host, name=name, python=python,
            watchdog_python=watchdog_python, shim_dir=shim_dir, offline=offline,
            output_dir=output_dir, dry_run=dry_run, system=system, user_name=user_name,
            server_args=server_args,
        )
        plan.inst = _with_group(plan.inst, hostfile, group_hosts, backend, remote_shim_path)
    except sv.FlagError as exc:
        raise _flag_error(exc) from exc
    try:
        _apply_install(plan)
    except sv.InstallError as exc:
        raise click.ClickException(str(exc)) from exc


@click.command("uninstall", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("manager", type=click.Choice(MANAGERS))
@click.option("--name", default=None,
              help="Instance name (default: mlx-PORT with --port, or the only installed one).")
@click.option("--port", type=click.IntRange(1, 65535), default=None,
              help="Derive the default name mlx-PORT.")
@click.option("--system", is_flag=True, help="systemd only: the system service.")
@click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The --output-dir given to install.")
@click.option("--dry-run", is_flag=True, help="Print what would be run and removed.")
def uninstall_command(manager: str, name: Optional[str], port: Optional[int], system: bool,
                      output_dir: Optional[Path], dry_run: bool) -> None:
    """Stop and remove what `install MANAGER` installed for one instance.

    launchctl bootout gui/UID/LABEL (watchdog, then server), or systemctl
    [--user] disable --now + daemon-reload; then removes the definitions,
    the generated config and the manifest. Nothing else: state, heartbeat and
    log files are kept, and a file not written by install is never removed.
    """
    from . import services as sv

    try:
        _uninstall(manager, name=name, port=port, system=system, output_dir=output_dir,
                   dry_run=dry_run)
    except sv.FlagError as exc:
        raise _flag_error(exc) from exc
    except sv.InstallError as exc:
        raise click.ClickException(str(exc)) from exc


# --------------------------------------------------------------------------
# install
# --------------------------------------------------------------------------


def _backend(manager: str):
    if manager == "launchd":
        from . import launchd as backend
    else:
        from . import systemd as backend
    return backend


def _prepare_install(*, manager, model, port, host, name, python, watchdog_python, shim_dir,
                     offline, output_dir, dry_run, system, user_name,
                     server_args) -> SimpleNamespace:
    from . import services as sv
    from . import shim as shim_module

    if system and manager != "systemd":
        raise sv.FlagError("--system", "is for systemd only (launchd installs LaunchAgents)")
    if user_name is not None:
        if not system:
            raise sv.FlagError("--user-name", "only applies with --system")
        sv.check_user_name(user_name)
        _check_user_exists(user_name)
    if user_name == "root":
        user_name = None
    name = sv.check_name(name if name is not None else sv.default_name(port))
    for arg in server_args:
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in arg):
            raise sv.FlagError("SERVER_ARGS", f"{arg!r} contains a control character")
        flag = arg.split("=", 1)[0]
        if flag in ("--host", "--port", "--model"):
            # The server would listen (or load) elsewhere than the watchdog
            # probes, and a --host after -- could expose it on every interface.
            raise sv.FlagError("SERVER_ARGS", f"{flag} after -- is not allowed: give it as "
                                              f"install's own {flag} (before --)")
    if not host:
        raise sv.FlagError("--host", "must not be empty")
    for flag, value in (("--model", model), ("--host", host), ("--python", python),
                        ("--watchdog-python", watchdog_python), ("--shim-dir", shim_dir)):
        if value is not None and any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
            raise sv.FlagError(flag, f"{value!r} contains a control character (a newline?)")

    server_python = sv.resolve_executable(python or sys.executable, "--python")
    _check_python_module(server_python, "mlx_lm", "--python")
    if watchdog_python is None:
        wd_python = os.path.abspath(sys.executable)
    else:
        wd_python = sv.resolve_executable(watchdog_python, "--watchdog-python")
        _check_python_module(wd_python, "mlx_watchdog", "--watchdog-python")

    if manager == "systemd":
        from . import systemd

        for flag, path in (("--python", server_python), ("--watchdog-python", wd_python)):
            try:
                systemd.check_executable(path)
            except ValueError as exc:
                raise sv.FlagError(flag, str(exc)) from None

    model_value, local = sv.resolve_model(model)
    if not local:
        hint = " and be in the local cache (--offline)" if offline else ""
        click.echo(f"warning: --model {model!r} is not a local path; the server will treat it "
                   f"as a Hugging Face repo id, which must exist{hint}.", err=True)

    if shim_dir is None:
        try:
            shim_path = str(shim_module.shim_dir())
        except FileNotFoundError as exc:
            raise sv.FlagError("--shim-dir", str(exc)) from exc
    else:
        shim_path = os.path.abspath(os.path.expanduser(shim_dir))
        if not os.path.isfile(os.path.join(shim_path, "sitecustomize.py")):
            raise sv.FlagError("--shim-dir", f"{shim_dir!r} has no sitecustomize.py")

    home = Path.home()
    layout = sv.default_layout(manager, home=home, system=system, environ=os.environ,
                               output_dir=output_dir)
    existing = sv.Manifest.load(sv.manifest_path(layout, name))
    if existing is not None and existing.manager != manager:
        raise sv.FlagError("--name", f"{name!r} is installed for {existing.manager} in "
                                     f"{layout.config_dir}; choose another --name or --output-dir")
    live = existing if existing is not None and not existing.dry_run else None

    others = sv.other_instances_on_port(layout, name, port)
    if others:
        raise sv.FlagError("--port", f"{port} is already used by installed instance "
                                     f"{', '.join(others)}")
    if live is not None and live.port == port and live.host == host:
        pass  # re-install: the port is (probably) held by this instance's own server
    else:
        sv.check_port_free(host, port)

    inst = sv.Instance(
        manager=manager, name=name, model=model_value, host=host, port=port,
        python=server_python, watchdog_python=wd_python, shim_dir=shim_path, layout=layout,
        server_args=tuple(server_args), offline=offline, system=system, user_name=user_name,
        watchdog_launcher=sv.watchdog_launcher(wd_python),
    )
    uid = os.getuid() if hasattr(os, "getuid") else 0
    if uid == 0 and not dry_run and not system:
        what = ("launchd agents of root (gui/0) rarely run: install as the user who is "
                "logged in" if manager == "launchd"
                else "--user units of root need root's user manager; did you mean --system?")
        click.echo(f"warning: running as root: {what}", err=True)
    return SimpleNamespace(inst=inst, existing=existing, live=live, dry_run=dry_run, uid=uid)


def _with_group(inst, hostfile, hosts, backend, remote_shim_path):
    """inst as a distributed group when --hostfile/--hosts is given (group.py)."""
    import dataclasses

    from . import services as sv
    from .group import GroupError, install_options

    try:
        launch = install_options(python=inst.python, hostfile=hostfile, hosts=hosts,
                                 backend=backend)
    except GroupError as exc:
        raise sv.FlagError("--hostfile" if hostfile else "--hosts", str(exc)) from exc
    if launch is None:
        return inst
    return dataclasses.replace(inst, group_launch=launch,
                               remote_shim_dir=remote_shim_path or inst.shim_dir)


def _check_python_module(python: str, module: str, flag: str) -> None:
    from . import services as sv

    found = sv.python_has_module(python, module)
    if found is None:
        raise sv.FlagError(flag, f"{python} does not run as a Python interpreter")
    if not found:
        raise sv.FlagError(flag, f"{python} cannot import {module}")


def _check_user_exists(user: str) -> None:
    from . import services as sv

    try:
        import pwd
    except ImportError:  # pragma: no cover - not POSIX
        return
    try:
        pwd.getpwnam(user)
    except KeyError as exc:
        raise sv.FlagError("--user-name", f"no such user {user!r}") from exc


def _apply_install(plan) -> None:
    from . import services as sv

    inst = plan.inst
    backend = _backend(inst.manager)
    files = backend.render(inst)
    allowed = set(plan.existing.files) if plan.existing else set()
    for path in files:
        if path.exists() and str(path) not in allowed and not sv.is_ours(path):
            raise sv.InstallError(
                f"refusing to overwrite {path}: it was not written by mlx-watchdog "
                "(choose another --name)")

    services = _service_names(inst)
    manifest = sv.Manifest(
        manager=inst.manager, name=inst.name, system=inst.system, host=inst.host,
        port=inst.port, files=[str(p) for p in files] + [str(inst.manifest_path)],
        services=services, dry_run=plan.dry_run,
    )
    try:
        for path, data in files.items():
            sv.write_file(path, data)
        sv.write_file(inst.manifest_path, manifest.to_json().encode())
        if not plan.dry_run and not inst.system:
            # launchd does not create the folders of StandardOutPath; the
            # shim and the watchdog write into state_dir.
            for folder in (inst.layout.state_dir, inst.layout.log_dir):
                if folder is not None:
                    folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise sv.InstallError(f"cannot write {exc.filename or ''}: {exc.strerror}"
                              + (" (use --output-dir, or run as root)" if inst.system else "")) from None

    for path in files:
        click.echo(f"wrote {path}")
    click.echo(f"wrote {inst.manifest_path}")

    failure_hint = (
        f"The files are in place in {inst.layout.unit_dir}; fix the problem and re-run "
        f"install, or remove them with `mlx-watchdog uninstall {inst.manager} --name {inst.name}"
        + (" --system" if inst.system else "")
        + (f" --output-dir {sv.shell_join([str(inst.layout.unit_dir)])}"
           if _custom_dir(inst) else "")
        + "`."
    )
    try:
        if inst.manager == "launchd":
            _load_launchd(inst, files, plan.uid, plan.dry_run)
        else:
            _load_systemd(inst, files, reinstall=plan.live is not None, dry_run=plan.dry_run)
    except sv.InstallError as exc:
        raise sv.InstallError(f"{exc}\n{failure_hint}") from exc

    if plan.dry_run:
        click.echo("dry run: nothing was loaded.")
        return
    click.echo(f"installed {inst.name}: {' + '.join(services)}; server at {inst.url}")
    if inst.manager == "launchd":
        click.echo(f"logs: {inst.layout.log_dir}/{inst.name}.{{out,err}}.log")
    else:
        flag = "" if inst.system else "--user "
        click.echo(f"logs: journalctl {flag}-u {services[0]} -u {services[1]}")
        if not inst.system:
            _linger_hint()


def _custom_dir(inst) -> bool:
    from . import services as sv

    standard = sv.standard_unit_dir(inst.manager, home=Path.home(), system=inst.system,
                                    environ=os.environ)
    return Path(inst.layout.unit_dir) != standard


def _service_names(inst) -> List[str]:
    if inst.manager == "launchd":
        from . import launchd

        return launchd.labels(inst.name)
    from . import systemd

    return systemd.unit_names(inst.name)


def _load_launchd(inst, files: Dict[Path, bytes], uid: int, dry_run: bool) -> None:
    from . import launchd

    labels = launchd.labels(inst.name)
    plists = [launchd.plist_path(inst.layout.unit_dir, label) for label in labels]
    if dry_run:
        for label in reversed(labels):
            _show(launchd.bootout_argv(uid, label), "only if loaded")
        for plist in plists:
            _show(launchd.bootstrap_argv(uid, plist))
        return
    # Re-install: unload the old jobs first (watchdog first, so that it does
    # not restart the server while it is being stopped), then load the new.
    for label in reversed(labels):
        if _launchd_loaded(uid, label):
            _run(launchd.bootout_argv(uid, label))
            _wait_unloaded(uid, label)
    for plist in plists:
        _run(launchd.bootstrap_argv(uid, plist))


def _launchd_loaded(uid: int, label: str) -> bool:
    from . import launchd

    return _run(launchd.print_argv(uid, label), check=False, quiet=True).returncode == 0


def _wait_unloaded(uid: int, label: str, timeout: float = 10.0) -> None:
    # bootout can return before launchd has forgotten the job; bootstrapping
    # it again too early fails with "Bootstrap failed: 5: Input/output error".
    import time

    deadline = time.monotonic() + timeout
    while _launchd_loaded(uid, label) and time.monotonic() < deadline:
        time.sleep(0.2)


def _load_systemd(inst, files: Dict[Path, bytes], *, reinstall: bool, dry_run: bool) -> None:
    from . import systemd

    unit_paths = None
    if _custom_dir(inst):
        unit_paths = [inst.layout.unit_dir / u for u in systemd.unit_names(inst.name)]
    argvs = systemd.install_argvs(inst.name, system=inst.system, reinstall=reinstall,
                                  unit_paths=unit_paths)
    if dry_run:
        for argv in argvs:
            _show(argv)
        return
    for argv in argvs:
        _run(argv)


def _linger_hint() -> None:
    try:
        import pwd

        user = pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):  # pragma: no cover
        return
    if not os.path.exists(f"/var/lib/systemd/linger/{user}"):
        click.echo(f"note: user services stop at logout and do not start at boot unless "
                   f"lingering is on: loginctl enable-linger {user}")


# --------------------------------------------------------------------------
# uninstall
# --------------------------------------------------------------------------


def _uninstall(manager: str, *, name: Optional[str], port: Optional[int], system: bool,
               output_dir: Optional[Path], dry_run: bool) -> None:
    from . import services as sv

    if system and manager != "systemd":
        raise sv.FlagError("--system", "is for systemd only")
    layout = sv.default_layout(manager, home=Path.home(), system=system, environ=os.environ,
                               output_dir=output_dir)
    if name is None and port is not None:
        name = sv.default_name(port)
    if name is None:
        names = sv.installed_names(layout)
        if len(names) != 1:
            found = f"installed: {', '.join(names)}" if names else \
                f"no install manifest in {layout.config_dir}"
            raise sv.FlagError("--name", f"required ({found})")
        name = names[0]
    name = sv.check_name(name)
    manifest = sv.Manifest.load(sv.manifest_path(layout, name))
    foreign_manifest = manifest is not None and manifest.manager != manager
    if foreign_manifest:  # a shared --output-dir: that config belongs to the other manager
        manifest = None

    if manager == "launchd":
        from . import launchd

        definitions = [launchd.plist_path(layout.unit_dir, lb) for lb in launchd.labels(name)]
    else:
        from . import systemd

        definitions = [layout.unit_dir / u for u in systemd.unit_names(name)]
    candidates = list(definitions)
    if not foreign_manifest:
        candidates += [layout.config_dir / f"{name}.toml", sv.manifest_path(layout, name)]
    listed = set(manifest.files) if manifest else set()
    to_remove, kept = [], []
    for path in candidates:
        if path.exists() or path.is_symlink():
            (to_remove if (str(path) in listed or sv.is_ours(path)) else kept).append(path)

    uid = os.getuid() if hasattr(os, "getuid") else 0
    if manager == "launchd":
        from . import launchd

        for label in reversed(launchd.labels(name)):
            if dry_run:
                _show(launchd.bootout_argv(uid, label), "only if loaded")
            elif _launchd_loaded(uid, label):
                _run(launchd.bootout_argv(uid, label))
    else:
        from . import systemd

        unit_files_present = any(p in to_remove for p in definitions)
        if unit_files_present:
            argv = systemd.disable_argv(name, system=system)
            if dry_run:
                _show(argv)
            else:
                try:
                    _run(argv)
                except sv.InstallError as exc:
                    raise sv.InstallError(f"{exc}\nNothing was removed.") from exc

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
            raise sv.InstallError(f"cannot remove {path}: {exc.strerror}") from exc
        click.echo(f"removed {path}")
    for path in kept:
        click.echo(f"warning: kept {path}: not written by mlx-watchdog install", err=True)

    if manager == "systemd" and any(p in to_remove for p in definitions):
        from . import systemd

        argv = systemd.daemon_reload_argv(system)
        if dry_run:
            _show(argv)
        else:
            _run(argv)
    if not to_remove and not dry_run:
        click.echo(f"nothing installed for {name} in {layout.unit_dir}")
    elif not dry_run:
        click.echo(f"uninstalled {name}")


# --------------------------------------------------------------------------
# running commands
# --------------------------------------------------------------------------


def _join(argv: Sequence[str]) -> str:
    from .services import shell_join

    return shell_join(argv)


def _show(argv: Sequence[str], note: Optional[str] = None) -> None:
    click.echo(f"would run: {_join(argv)}" + (f"   # {note}" if note else ""))


def _run(argv: Sequence[str], *, check: bool = True, quiet: bool = False):
    import subprocess

    from . import services as sv

    if not quiet:
        click.echo(f"$ {_join(argv)}")
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise sv.InstallError(f"{argv[0]}: command not found") from exc
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout or "").strip()
        raise sv.InstallError(f"`{_join(argv)}` failed with exit status {proc.returncode}"
                              + (f": {detail}" if detail else ""))
    return proc


# --------------------------------------------------------------------------
# Reference files (repo folders launchd/ and systemd/)
# --------------------------------------------------------------------------

#: The documented arguments the reference files are generated for.
REFERENCE_ARGS = {
    "name": "mlx-8080",
    "model": "/models/demo",
    "host": "127.0.0.1",
    "port": 8080,
    "python": "/opt/mlx/bin/python",
    "shim_dir": "/opt/mlx-watchdog/sitecustomize",
    "macos_home": "/Users/you",
    "macos_uid": 501,
    "linux_home": "/home/you",
    "linux_user": "you",
}


def _reference_instance(manager: str, system: bool = False):
    from . import services as sv

    a = REFERENCE_ARGS
    home = Path(a["macos_home"] if manager == "launchd" else a["linux_home"])
    layout = sv.default_layout(manager, home=home, system=system, environ={})
    return sv.Instance(
        manager=manager, name=a["name"], model=a["model"], host=a["host"], port=a["port"],
        python=a["python"], watchdog_python=a["python"], shim_dir=a["shim_dir"],
        layout=layout, system=system, user_name=a["linux_user"] if system else None,
        watchdog_launcher=(str(Path(a["python"]).parent / "mlx-watchdog"),),
    )


def reference_files() -> Dict[str, bytes]:
    """{repo-relative path: content} of the reference folders."""
    from . import launchd, systemd

    out: Dict[str, bytes] = {}
    variants = [("launchd", "launchd", False), ("systemd", "systemd", False),
                ("systemd", "systemd/system", True)]
    for manager, folder, system in variants:
        inst = _reference_instance(manager, system)
        backend = launchd if manager == "launchd" else systemd
        for path, data in backend.render(inst).items():
            out[f"{folder}/{path.name}"] = data
    out["launchd/README.md"] = _reference_readme_launchd().encode()
    out["systemd/README.md"] = _reference_readme_systemd().encode()
    return out


def _reference_readme_launchd() -> str:
    from . import launchd

    a = REFERENCE_ARGS
    inst = _reference_instance("launchd")
    uid = a["macos_uid"]
    plists = [launchd.plist_path(inst.layout.unit_dir, lb) for lb in launchd.labels(inst.name)]
    cmds = [_join(launchd.bootstrap_argv(uid, p)) for p in plists]
    return f"""# launchd reference files

Generated by `scripts/write-service-reference` from the same code as
`mlx-watchdog install launchd`; `tests/test_install.py` fails when they drift.
Do not edit them by hand.

They are what this command writes, run as user `you` (uid {uid}, home
`{a['macos_home']}`), with mlx-watchdog and mlx-lm installed in `/opt/mlx` (so
`{a['python']}` is the default `--python` and `--watchdog-python`, and the
watchdog runs `/opt/mlx/bin/mlx-watchdog`):

    /opt/mlx/bin/mlx-watchdog install launchd --name {a['name']} \\
        --model {a['model']} --host {a['host']} --port {a['port']} \\
        --python {a['python']} --shim-dir {a['shim_dir']}

| file here | installed as |
|---|---|
| `{plists[0].name}` | `{plists[0]}` |
| `{plists[1].name}` | `{plists[1]}` |
| `{inst.config_path.name}` | `{inst.config_path}` |

Install also writes `{inst.manifest_path}` (the list of files uninstall
removes), creates `{inst.layout.log_dir}` (server logs
`{a['name']}.out.log` / `{a['name']}.err.log`), and runs:

    {cmds[0]}
    {cmds[1]}

(after `launchctl bootout gui/{uid}/LABEL`, watchdog first, for jobs already loaded).
`mlx-watchdog uninstall launchd --name {a['name']}` boots both out and removes
those files.
"""


def _reference_readme_systemd() -> str:
    from . import systemd

    a = REFERENCE_ARGS
    user = _reference_instance("systemd")
    sysi = _reference_instance("systemd", system=True)
    units = systemd.unit_names(a["name"])
    user_cmds = "\n    ".join(_join(c) for c in systemd.install_argvs(
        a["name"], system=False, reinstall=False))
    sys_cmds = "\n    ".join(_join(c) for c in systemd.install_argvs(
        a["name"], system=True, reinstall=False))
    return f"""# systemd reference files

Generated by `scripts/write-service-reference` from the same code as
`mlx-watchdog install systemd`; `tests/test_install.py` fails when they drift.
Do not edit them by hand.

## User services (this folder)

What this command writes, run as user `you` (home `{a['linux_home']}`, default
XDG directories), with mlx-watchdog and mlx-lm installed in `/opt/mlx` (so
`{a['python']}` is the default `--python` and `--watchdog-python`, and the
watchdog runs `/opt/mlx/bin/mlx-watchdog`):

    /opt/mlx/bin/mlx-watchdog install systemd --name {a['name']} \\
        --model {a['model']} --host {a['host']} --port {a['port']} \\
        --python {a['python']} --shim-dir {a['shim_dir']}

| file here | installed as |
|---|---|
| `{units[0]}` | `{user.layout.unit_dir / units[0]}` |
| `{units[1]}` | `{user.layout.unit_dir / units[1]}` |
| `{user.config_path.name}` | `{user.config_path}` |

then (plus the manifest `{user.manifest_path}`):

    {user_cmds}

## System services (`system/`)

The same with `--system --user-name {a['linux_user']}`, run as root:

| file here | installed as |
|---|---|
| `system/{units[0]}` | `{sysi.layout.unit_dir / units[0]}` |
| `system/{units[1]}` | `{sysi.layout.unit_dir / units[1]}` |
| `system/{sysi.config_path.name}` | `{sysi.config_path}` |

then (plus the manifest `{sysi.manifest_path}`):

    {sys_cmds}

The server runs as `{a['linux_user']}` (`User=`) with `StateDirectory=mlx-watchdog`;
the watchdog runs as root so that it may restart the system unit, and keeps
its state in its own root-owned `StateDirectory=mlx-watchdog-root`.

Logs go to the journal: `journalctl --user -u {units[0]}` (without `--user`
for the system units). Check units with `systemd-analyze verify` (it needs the
ExecStart= binaries to exist, so not these: the tests verify units generated
for a real Python).
"""


def write_reference(root: Path) -> List[Path]:
    written = []
    for rel, data in reference_files().items():
        path = Path(root) / rel
        if path.exists() and path.read_bytes() == data:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written.append(path)
    return written


def reference_drift(root: Path) -> List[str]:
    """Problems between the committed reference folders and the code."""
    expected = reference_files()
    problems = []
    for rel, data in sorted(expected.items()):
        path = Path(root) / rel
        if not path.exists():
            problems.append(f"missing: {rel}")
        elif path.read_bytes() != data:
            problems.append(f"differs: {rel}")
    for folder in ("launchd", "systemd"):
        base = Path(root) / folder
        if base.is_dir():
            for path in sorted(base.rglob("*")):
                rel = path.relative_to(root).as_posix()
                if path.is_file() and rel not in expected:
                    problems.append(f"not generated: {rel}")
    return problems


def _reference_main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m mlx_watchdog.install_cli",
        description="Write or check the reference files in launchd/ and systemd/.")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write-reference", action="store_true")
    group.add_argument("--check-reference", action="store_true")
    parser.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[2]),
                        help="repository root (default: this checkout)")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if args.write_reference:
        for path in write_reference(root):
            print(f"wrote {path}")
        extra = [p for p in reference_drift(root) if p.startswith("not generated")]
        for problem in extra:
            print(f"warning: {problem} (remove it by hand)", file=sys.stderr)
        return 0
    problems = reference_drift(root)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print("reference files drifted: run scripts/write-service-reference", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(_reference_main())
