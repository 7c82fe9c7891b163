"""systemd definitions: a server unit and a watchdog unit per instance.

Rendering is pure (the units and the systemctl command lines; they pass
`systemd-analyze verify`); SystemdBackend loads and unloads them through a
commands.Runner for execute.py.

Choices, and why (also written as comments into the units):
- Server Type=notify + NotifyAccess=main: the shim, inside the server process
  (the main PID: ExecStart runs python directly), sends READY=1 once the model
  is loaded and WATCHDOG=1 from the generation loop.
- TimeoutStartSec=600: start-up lasts until READY=1, i.e. includes the model
  load, which can take minutes for a large model or a first download.
- WatchdogSec=60: systemd only arms it after READY=1. The idle generation loop
  wakes every 0.1 s, so a healthy server pings about every 30 s (the shim
  rate-limits to half the interval); 60 s without a ping means the loop is
  wedged, and systemd kills (SIGABRT) and restarts the server.
- Restart=on-failure: exit 70 (the shim's "generation thread died"),
  signals, watchdog and start time-outs restart; a clean exit does not.
- Never down for good: StartLimitIntervalSec=0 in [Unit] turns the start
  limit off (a limit leaves the unit failed, with nothing to bring it back).
  Storm control is RestartSec=5 between systemd's own restarts (a model load
  takes longer than that anyway), and the watchdog's backoff (1 s doubling to
  60 s) for its restarts. RestartSteps/RestartMaxDelaySec would grow
  RestartSec, but only systemd 254+ knows them and older ones warn, so they
  are left out. The watchdog answers start-limit-hit (a unit edited by hand)
  with reset-failed and a retry.
- TimeoutStopSec=30: SIGTERM, then SIGKILL after 30 s, the watchdog's stop
  grace. SIGKILL of a process holding a large wired model on macOS has been
  reported to leak the wired memory until reboot (jundot/omlx #2184).
- The watchdog unit is Type=simple, Restart=always, and Wants=/After= the
  server, so `enable --now` starts both and the watchdog starts after the
  server is ready (or failed).
- The listening socket (unless --no-socket): a NAME-server.socket unit holds
  --host:--port and the server inherits it (LISTEN_FDS; the shim serves on
  it), so while the server restarts connections wait in its backlog instead
  of being refused. The server Requires= and is After= it. A stopped server
  is started again by the next connection (socket activation): stop the
  .socket unit too to keep it down. A group (mlx.launch) binds on rank 0.
- TimeoutStopSec=30 is above the shim's drain (MLX_HOTFIX_DRAIN_TIMEOUT,
  25 s): a stop or restart lets the accepted requests finish first.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Sequence

from .. import defaults
from .instance import MARKER, InstallError, Instance, Layout, watchdog_config_toml

if TYPE_CHECKING:  # pragma: no cover
    from .commands import Runner
    from .plan import Plan

TIMEOUT_START_SEC = 600
WATCHDOG_SEC = 60
RESTART_SEC = 5
TIMEOUT_STOP_SEC = int(defaults.STOP_GRACE_S)
START_LIMIT_INTERVAL_SEC = 0  # no start limit: never failed for good

_SAFE_WORD = re.compile(r"[A-Za-z0-9_@%+=:,./-]+\Z")


def server_unit_name(name: str) -> str:
    return f"{name}-server.service"


def watchdog_unit_name(name: str) -> str:
    return f"{name}-watchdog.service"


def socket_unit_name(name: str) -> str:
    """The server's listening socket: same stem as the service it activates."""
    return f"{name}-server.socket"


def unit_names(name: str) -> List[str]:
    return [server_unit_name(name), watchdog_unit_name(name)]


def enabled_units(name: str, held_socket: bool) -> List[str]:
    """What install enables and starts: the socket first, when there is one."""
    return ([socket_unit_name(name)] if held_socket else []) + unit_names(name)


# ---- quoting (systemd.syntax(7), systemd.service(5) "Command lines") ----

def _check_line(value: str, what: str) -> None:
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ValueError(f"{what} {value!r} contains a control character")


def escape_specifiers(value: str) -> str:
    """'%' starts a specifier (%h, %n, ...) in almost every setting."""
    return value.replace("%", "%%")


def quote_exec_arg(arg: str) -> str:
    """One word of ExecStart=: specifiers (%) and variables ($) escaped,
    quoted with C-style escapes when it has anything but safe characters."""
    _check_line(arg, "argument")
    if arg == ";":
        return "\\;"  # a lone ';' would separate commands
    word = escape_specifiers(arg).replace("$", "$$")
    if _SAFE_WORD.match(word):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def check_executable(path: str) -> None:
    """ValueError unless systemd can run path as ExecStart='s first word.

    systemd refuses an executable name holding quotes or a backslash
    ("Executable name contains special characters"), however it is quoted,
    and expands no $VARIABLE in it.
    """
    if not path.startswith("/"):
        raise ValueError(f"ExecStart= needs an absolute path, got {path!r}")
    _check_line(path, "executable path")
    bad = sorted({c for c in path if c in "\"'\\"})
    if bad:
        raise ValueError(
            f"{path!r} contains {' '.join(bad)}, which systemd refuses in an executable's "
            "path whatever the quoting; use a path without them (a symlink will do)"
        )


def quote_executable(path: str) -> str:
    """The first word of ExecStart=: % escaped, $ literal (not expanded there)."""
    check_executable(path)
    word = escape_specifiers(path)
    return word if _SAFE_WORD.match(word) else f'"{word}"'


def exec_line(argv: Sequence[str]) -> str:
    if not argv:
        raise ValueError("ExecStart= needs a command")
    return " ".join([quote_executable(str(argv[0]))] + [quote_exec_arg(str(a)) for a in argv[1:]])


def environment_line(key: str, value: str) -> str:
    """Environment=KEY=VALUE, quoted when needed ($ is not expanded there)."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise ValueError(f"bad environment variable name {key!r}")
    _check_line(value, f"{key}=")
    assignment = f"{key}={escape_specifiers(value)}"
    if _SAFE_WORD.match(assignment):
        return f"Environment={assignment}"
    return 'Environment="' + assignment.replace("\\", "\\\\").replace('"', '\\"') + '"'


# ---- units ----

def _header(inst: Instance) -> List[str]:
    return [
        f"# {MARKER} for instance {inst.name}.",
        "# Re-run `mlx-watchdog install systemd` to change it; "
        "`mlx-watchdog uninstall systemd` removes it.",
    ]


def _wanted_by(inst: Instance) -> str:
    return "multi-user.target" if inst.system else "default.target"


def server_unit(inst: Instance) -> str:
    lines = _header(inst) + [
        "",
        "[Unit]",
        "Description=" + escape_specifiers(
            f"mlx_lm.server {inst.name} on {inst.url} (mlx-watchdog hotfix shim)"),
    ]
    if inst.system:
        # The model may be downloaded at start-up.
        lines += ["Wants=network-online.target", "After=network-online.target"]
    if inst.held_socket:
        socket = socket_unit_name(inst.name)
        lines += [
            "# Serves on the listening socket of this unit, which outlives the server",
            "# process: connections wait there while it restarts.",
            f"Requires={socket}",
            f"After={socket}",
        ]
    lines += [
        "# Never failed for good: no start limit (the watchdog backs off its restarts).",
        f"StartLimitIntervalSec={START_LIMIT_INTERVAL_SEC}",
        "",
        "[Service]",
        "# The shim in the server process sends READY=1 after the model load and",
        "# WATCHDOG=1 from the generation loop.",
        "Type=notify",
        # A group's READY=1 and WATCHDOG=1 come from its ranks, not the main process.
        "NotifyAccess=" + ("all" if inst.group_launch else "main"),
        "ExecStart=" + exec_line(inst.server_argv()),
    ]
    lines += [environment_line(k, v) for k, v in inst.server_env().items()]
    if inst.system:
        if inst.user_name:
            lines.append(f"User={inst.user_name}")
        # /var/lib/mlx-watchdog, owned by User=: heartbeat and watchdog state.
        lines.append("StateDirectory=mlx-watchdog")
    lines += [
        "# Start-up lasts until READY=1, model load included.",
        f"TimeoutStartSec={TIMEOUT_START_SEC}",
        "# Armed after READY=1; the shim pings at most every WatchdogSec/2.",
        f"WatchdogSec={WATCHDOG_SEC}",
        "# A missed ping sends SIGABRT: with PYTHONFAULTHANDLER=1 every thread's",
        "# stack goes to the journal (where the loop hung); no core file, since",
        "# a core of a loaded model is gigabytes.",
        "WatchdogSignal=SIGABRT",
        "Environment=PYTHONFAULTHANDLER=1",
        "LimitCORE=0",
        "# Exit 70 (generation thread died), signals and time-outs restart.",
        "Restart=on-failure",
        f"RestartSec={RESTART_SEC}",
        "# SIGTERM (the shim drains: accepted requests finish, at most 25 s), then",
        "# SIGKILL after this long: SIGKILL of a large wired model has been",
        "# reported to leak its memory (jundot/omlx #2184).",
        f"TimeoutStopSec={TIMEOUT_STOP_SEC}",
        "",
        "[Install]",
        f"WantedBy={_wanted_by(inst)}",
    ]
    return "\n".join(lines) + "\n"


def listen_stream(inst: Instance) -> str:
    """ListenStream=: ADDRESS:PORT, an IPv6 address in brackets."""
    address, family = inst.listen_address()
    return f"[{address}]:{inst.port}" if family == "IPv6" else f"{address}:{inst.port}"


def socket_unit(inst: Instance) -> str:
    lines = _header(inst) + [
        "",
        "[Unit]",
        "Description=" + escape_specifiers(
            f"listening socket of mlx_lm.server {inst.name} on {inst.url}, held across "
            "restarts"),
        "",
        "[Socket]",
        "# The server inherits this socket (LISTEN_FDS) instead of binding the port;",
        "# while it restarts, new connections wait in the backlog for the next one.",
        f"ListenStream={listen_stream(inst)}",
        f"Service={server_unit_name(inst.name)}",
        "",
        "[Install]",
        "WantedBy=sockets.target",
    ]
    return "\n".join(lines) + "\n"


def watchdog_unit(inst: Instance) -> str:
    server = server_unit_name(inst.name)
    lines = _header(inst) + [
        "",
        "[Unit]",
        "Description=" + escape_specifiers(f"mlx-watchdog for {inst.name} ({inst.url})"),
        f"Wants={server}",
        f"After={server}",
        "",
        "[Service]",
        "Type=simple",
        "ExecStart=" + exec_line(inst.watchdog_argv()),
    ]
    lines += [environment_line(k, v) for k, v in inst.watchdog_env().items()]
    # --system: the watchdog runs as root (no User=) so that it may restart
    # the system unit of the server. Root keeps its state in a folder of its
    # own: the server's StateDirectory belongs to User=, who could plant a
    # link or a FIFO there.
    if inst.system and inst.user_name:
        lines.append(f"StateDirectory={inst.watchdog_state_dir.name}")
    lines += [
        "Restart=always",
        f"RestartSec={RESTART_SEC}",
        "",
        "[Install]",
        f"WantedBy={_wanted_by(inst)}",
    ]
    return "\n".join(lines) + "\n"


def restart_action(inst: Instance) -> Dict[str, object]:
    return {"type": "systemd", "unit": server_unit_name(inst.name), "user": not inst.system}


def render(inst: Instance) -> Dict[Path, bytes]:
    """All files for one instance: {absolute path: content}."""
    unit_dir = inst.layout.unit_dir
    files = {}
    if inst.held_socket:
        files[unit_dir / socket_unit_name(inst.name)] = socket_unit(inst).encode()
    files.update({
        unit_dir / server_unit_name(inst.name): server_unit(inst).encode(),
        unit_dir / watchdog_unit_name(inst.name): watchdog_unit(inst).encode(),
        inst.config_path: watchdog_config_toml(inst, restart_action(inst)).encode(),
    })
    return files


# ---- systemctl command lines ----

def systemctl(system: bool) -> List[str]:
    return ["systemctl"] if system else ["systemctl", "--user"]


def install_argvs(name: str, *, system: bool, reinstall: bool,
                  unit_paths: Optional[Sequence[Path]] = None,
                  held_socket: bool = False) -> List[List[str]]:
    """daemon-reload, then enable and start (or restart, when updating).

    unit_paths: when the units are not in a directory systemd searches (a
    custom --output-dir), enable them by path, which links them in first.
    held_socket: the server's .socket unit too (first).
    """
    base = systemctl(system)
    units = enabled_units(name, held_socket)
    targets = [str(p) for p in unit_paths] if unit_paths else units
    if reinstall:
        return [base + ["daemon-reload"], base + ["enable"] + targets, base + ["restart"] + units]
    return [base + ["daemon-reload"], base + ["enable", "--now"] + targets]


def disable_argv(name: str, *, system: bool, held_socket: bool = False) -> List[str]:
    # Watchdog first, so that it does not restart the server being stopped
    # (and the socket with them: it would start the server again).
    return systemctl(system) + ["disable", "--now"] + list(
        reversed(enabled_units(name, held_socket)))


def daemon_reload_argv(system: bool) -> List[str]:
    return systemctl(system) + ["daemon-reload"]


# ---- the backend (backend.ServiceBackend) ----

class SystemdBackend:
    manager = "systemd"
    supports_system = True
    root_warning = "--user units of root need root's user manager; did you mean --system?"

    def service_names(self, name: str) -> List[str]:
        return unit_names(name)

    def definition_paths(self, unit_dir: Path, name: str) -> List[Path]:
        # The socket unit last: uninstall removes it when an install wrote it.
        return [Path(unit_dir) / unit for unit in unit_names(name) + [socket_unit_name(name)]]

    def standard_layout(self, *, home: Path, system: bool,
                        environ: Mapping[str, str]) -> Layout:
        if system:
            return Layout(Path("/etc/systemd/system"), Path("/etc/mlx-watchdog"),
                          Path("/var/lib/mlx-watchdog"))
        config = _xdg(environ, "XDG_CONFIG_HOME", home / ".config")
        return Layout(config / "systemd" / "user", config / "mlx-watchdog",
                      _xdg(environ, "XDG_STATE_HOME", home / ".local" / "state") / "mlx-watchdog")

    check_executable = staticmethod(check_executable)
    render = staticmethod(render)
    restart_action = staticmethod(restart_action)

    def load(self, plan: "Plan", runner: "Runner") -> None:
        inst = plan.inst
        unit_dir = inst.layout.unit_dir
        unit_paths = ([unit_dir / unit for unit in enabled_units(inst.name, inst.held_socket)]
                      if plan.custom_dir else None)
        stale_socket = unit_dir / socket_unit_name(inst.name)
        if plan.reinstall and not inst.held_socket and stale_socket.exists():
            # Re-installed with --no-socket: the old socket would still hold the port.
            runner.step(systemctl(inst.system) + ["disable", "--now",
                                                  socket_unit_name(inst.name)])
            if not runner.dry_run:
                stale_socket.unlink()
        for argv in install_argvs(inst.name, system=inst.system, reinstall=plan.reinstall,
                                  unit_paths=unit_paths, held_socket=inst.held_socket):
            runner.step(argv)

    def unload(self, name: str, *, system: bool, uid: int, runner: "Runner",
               definitions_present: bool) -> None:
        if not definitions_present:
            return  # nothing of ours to stop: disable would fail on unknown units
        socket = socket_unit_name(name)
        held = runner.dry_run or runner.succeeds(systemctl(system) + ["cat", socket])
        try:
            runner.step(disable_argv(name, system=system, held_socket=held))
        except InstallError as exc:
            raise InstallError(f"{exc}\nNothing was removed.") from exc

    def after_removal(self, *, system: bool, runner: "Runner") -> None:
        runner.step(daemon_reload_argv(system))

    def installed_notes(self, inst: Instance) -> List[str]:
        flag = "" if inst.system else "--user "
        server, watchdog = unit_names(inst.name)
        notes = [f"logs: journalctl {flag}-u {server} -u {watchdog}"]
        if not inst.system:
            from .hostcheck import linger_note

            note = linger_note()
            if note:
                notes.append(note)
        return notes


def _xdg(environ: Mapping[str, str], key: str, fallback: Path) -> Path:
    value = environ.get(key, "")
    # The XDG spec: a relative value is invalid and must be ignored.
    return Path(value) if value and os.path.isabs(value) else fallback
