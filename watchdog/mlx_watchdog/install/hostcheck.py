"""Checks of install's flags against this host: the model path, the Pythons
(and what they can import), the user, the port, the shim folder, a group's
hosts. Each raises FlagError naming the flag at fault.

Side effects: it reads the file system, runs the given Pythons, binds a
socket for a moment and, for a group, runs ssh (group.install_options).
"""

from __future__ import annotations

import errno
import os
import socket
from typing import Optional, Tuple

from .instance import FlagError


def looks_like_local_path(model: str) -> bool:
    return model.startswith(("/", ".", "~")) or os.path.isdir(os.path.expanduser(model))


def resolve_model(model: str) -> Tuple[str, bool]:
    """(model as the server should get it, is_local). Raises FlagError."""
    if not model:
        raise FlagError("--model", "must not be empty")
    if looks_like_local_path(model):
        path = os.path.abspath(os.path.expanduser(model))
        if not os.path.exists(path):
            raise FlagError("--model", f"{model!r}: no such file or directory")
        return path, True
    return model, False


def resolve_executable(value: str, flag: str) -> str:
    """An absolute path to an executable file. Not resolved through symlinks:
    a venv's bin/python must stay the venv's python."""
    import shutil

    candidate = value
    if os.sep not in value:
        found = shutil.which(value)
        if found is None:
            raise FlagError(flag, f"{value!r}: not found on PATH")
        candidate = found
    path = os.path.abspath(os.path.expanduser(candidate))
    if not os.path.isfile(path):
        raise FlagError(flag, f"{value!r}: no such file")
    if not os.access(path, os.X_OK):
        raise FlagError(flag, f"{value!r}: not executable")
    return path


def python_has_module(python: str, module: str, timeout: float = 60.0) -> Optional[bool]:
    """Whether `python` can import `module` (None if python could not run)."""
    import subprocess

    code = (
        "import importlib.util, sys\n"
        f"sys.exit(0 if importlib.util.find_spec({module!r}) else 3)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    try:
        proc = subprocess.run([python, "-c", code], env=env, capture_output=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode == 0:
        return True
    if proc.returncode == 3:
        return False
    return None


def check_port_free(host: str, port: int) -> None:
    """Raise FlagError if host:port cannot be bound here right now."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise FlagError("--host", f"{host!r}: cannot resolve ({exc.strerror})") from exc
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # Like the server's own listener: ignore TIME_WAIT leftovers, but fail
        # if something is listening.
        if os.name == "posix":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise FlagError("--port", f"{port} is already in use on {host}") from exc
        if exc.errno == errno.EADDRNOTAVAIL:
            raise FlagError("--host", f"{host!r} is not an address of this machine") from exc
        if exc.errno == errno.EACCES:
            raise FlagError("--port", f"{port} needs privileges to bind on {host}") from exc
        raise FlagError("--port", f"cannot bind {host}:{port}: {exc.strerror}") from exc
    finally:
        sock.close()


def check_python_module(python: str, module: str, flag: str) -> None:
    found = python_has_module(python, module)
    if found is None:
        raise FlagError(flag, f"{python} does not run as a Python interpreter")
    if not found:
        raise FlagError(flag, f"{python} cannot import {module}")


def check_user_exists(user: str) -> None:
    try:
        import pwd
    except ImportError:  # pragma: no cover - not POSIX
        return
    try:
        pwd.getpwnam(user)
    except KeyError as exc:
        raise FlagError("--user-name", f"no such user {user!r}") from exc


def resolve_shim_dir(shim_dir: Optional[str]) -> str:
    """The hotfix drop-in folder: the given one (it must hold a
    sitecustomize.py), else this installation's (`mlx-watchdog shim-path`)."""
    from .. import shim

    if shim_dir is None:
        try:
            return str(shim.shim_dir())
        except FileNotFoundError as exc:
            raise FlagError("--shim-dir", str(exc)) from exc
    path = os.path.abspath(os.path.expanduser(shim_dir))
    if not os.path.isfile(os.path.join(path, "sitecustomize.py")):
        raise FlagError("--shim-dir", f"{shim_dir!r} has no sitecustomize.py")
    return path


def watchdog_launcher(python: str) -> Tuple[str, ...]:
    """The `mlx-watchdog` console script next to python if there is one (its
    shebang is that python), else `python -m mlx_watchdog.cli`."""
    script = os.path.join(os.path.dirname(python), "mlx-watchdog")
    if os.path.isfile(script) and os.access(script, os.X_OK):
        return (script,)
    return (python, "-m", "mlx_watchdog.cli")


def group_launch(*, python: str, hostfile: Optional[str], hosts: Optional[str],
                 backend: Optional[str]) -> Tuple[str, ...]:
    """mlx.launch and its options for a group (--hostfile/--hosts), () for a
    lone server. Checks the hostfile and that ssh reaches every other host."""
    from ..group_hosts import GroupError
    from ..group_install import install_options

    try:
        launch = install_options(python=python, hostfile=hostfile, hosts=hosts, backend=backend)
    except GroupError as exc:
        raise FlagError("--hostfile" if hostfile else "--hosts", str(exc)) from exc
    return launch or ()


def linger_note() -> Optional[str]:
    """A note when this user's services stop at logout (systemd --user without linger)."""
    try:
        import pwd

        user = pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):  # pragma: no cover
        return None
    if os.path.exists(f"/var/lib/systemd/linger/{user}"):
        return None
    return (f"note: user services stop at logout and do not start at boot unless "
            f"lingering is on: loginctl enable-linger {user}")
