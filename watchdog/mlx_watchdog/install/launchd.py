"""launchd (macOS) definitions: two LaunchAgents per instance, built with plistlib.

Rendering is pure (the plists and the launchctl command lines); LaunchdBackend
loads and unloads them through a commands.Runner for execute.py.

Choices, and why:
- Server KeepAlive = {SuccessfulExit: false, Crashed: true}: relaunch after
  any non-zero exit (the shim exits 70 when the generation thread dies) or a
  crash signal; a clean exit 0 stays down.
- Server ThrottleInterval = 30: launchd's respawn throttle is the only storm
  control launchd has (there is no start-limit burst). It only delays a job
  that exits within that many seconds of its launch; a server that ran for
  hours and exited 70 is relaunched at once. A server that dies during start
  (bad model, out of memory) is relaunched every 30 s instead of every 10 s
  (the default), so a crash loop does not reload a multi-GB model six times a
  minute. `launchctl kickstart -k` (the watchdog's action) is not throttled.
- Server ProcessType = Interactive: launchd.plist(5) says Interactive jobs
  "run with the same resource limitations as apps, that is to say, none";
  Standard (the default) and Background jobs get resource limits (CPU and I/O
  priority, timer coalescing: App Nap-style throttling). An inference server
  answers requests whose latency the user waits on, and the watchdog's
  timing would misread a throttled server as wedged.
- Watchdog: KeepAlive = true (always running), ThrottleInterval = 10 (the
  default, stated explicitly), ProcessType = Standard: it is light, but
  Background would throttle its timers and I/O, and the watchdog judges
  "busy vs wedged" from timing, so it must not be slowed down.
- No NOTIFY_SOCKET: sd_notify is systemd's; the shim is a no-op without it.
- Server Sockets (unless --no-socket): launchd binds --host:--port itself
  (the "Listeners" entry) and keeps it across the server's restarts; the
  shim takes it with launch_activate_socket("Listeners"), named to it by
  MLX_HOTFIX_LAUNCHD_SOCKET, and serves on it, so connections wait in its
  backlog while the server restarts instead of being refused. The keys are
  launchd.plist(5)'s: SockNodeName, SockServiceName (the port, as a
  string), SockType "stream", SockFamily "IPv4"/"IPv6" (one socket: the
  shim serves exactly one). A group (mlx.launch) binds on rank 0.
"""

from __future__ import annotations

import os
import plistlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional

from .. import contract, defaults
from .instance import LABEL_PREFIX, MARKER, Instance, Layout, watchdog_config_toml

if TYPE_CHECKING:  # pragma: no cover
    from .commands import Runner
    from .plan import Plan

SERVER_THROTTLE_INTERVAL = 30
SOCKET_NAME = "Listeners"  # the Sockets key the shim asks launchd for
# launchd's SIGTERM-to-SIGKILL time (default 20 s), raised to the watchdog's
# stop grace: SIGKILL of a process holding a large wired model has been
# reported to leak the wired memory until reboot (jundot/omlx #2184).
SERVER_EXIT_TIMEOUT = int(defaults.STOP_GRACE_S)
WATCHDOG_THROTTLE_INTERVAL = 10


def server_label(name: str) -> str:
    return f"{LABEL_PREFIX}.{name}.server"


def watchdog_label(name: str) -> str:
    return f"{LABEL_PREFIX}.{name}.watchdog"


def plist_path(unit_dir: Path, label: str) -> Path:
    return Path(unit_dir) / f"{label}.plist"


def server_plist(inst: Instance) -> dict:
    env = inst.server_env()
    sockets = {}
    if inst.held_socket:
        env[contract.LAUNCHD_SOCKET_ENV] = SOCKET_NAME
        sockets["Sockets"] = {SOCKET_NAME: socket_entry(inst)}
    return _job(
        inst, server_label(inst.name), inst.server_argv(), env, inst.name,
        KeepAlive={"SuccessfulExit": False, "Crashed": True},
        ThrottleInterval=SERVER_THROTTLE_INTERVAL,
        # SIGTERM (the shim drains, at most 25 s), then SIGKILL after this
        # long: the watchdog's stop grace.
        ExitTimeOut=SERVER_EXIT_TIMEOUT,
        ProcessType="Interactive",
        **sockets,
    )


def socket_entry(inst: Instance) -> dict:
    """The Sockets entry of the server's listening socket (launchd.plist(5))."""
    address, family = inst.listen_address()
    return {"SockNodeName": address, "SockServiceName": str(inst.port), "SockType": "stream",
            "SockFamily": family}


def watchdog_plist(inst: Instance) -> dict:
    return _job(
        inst, watchdog_label(inst.name), inst.watchdog_argv(), inst.watchdog_env(),
        f"{inst.name}.watchdog",
        KeepAlive=True,
        ThrottleInterval=WATCHDOG_THROTTLE_INTERVAL,
        ProcessType="Standard",
    )


def _job(inst: Instance, label: str, argv: List[str], env: Dict[str, str], log_stem: str,
         **settings: object) -> dict:
    """A job started at load, logging to <log_dir>/<log_stem>.{out,err}.log."""
    log_dir = _log_dir(inst)
    return {
        "Label": label,
        "ProgramArguments": argv,
        "EnvironmentVariables": env,
        "RunAtLoad": True,
        "StandardOutPath": str(log_dir / f"{log_stem}.out.log"),
        "StandardErrorPath": str(log_dir / f"{log_stem}.err.log"),
        **settings,
    }


def _log_dir(inst: Instance) -> Path:
    if inst.layout.log_dir is None:
        raise ValueError("launchd layout needs a log_dir")
    return inst.layout.log_dir


def dump_plist(data: dict, comment: str) -> bytes:
    """plistlib XML with an XML comment (the installer's marker) before <plist>."""
    raw = plistlib.dumps(data, fmt=plistlib.FMT_XML, sort_keys=True)
    head, sep, rest = raw.partition(b"<plist ")
    if not sep:  # pragma: no cover - plistlib always writes <plist version=...>
        return raw
    return head + f"<!-- {comment} -->\n".encode() + sep + rest


def restart_action(inst: Instance) -> Dict[str, object]:
    return {"type": "launchd", "label": server_label(inst.name)}


def render(inst: Instance) -> Dict[Path, bytes]:
    """All files for one instance: {absolute path: content}, in load order."""
    comment = (
        f"{MARKER} for instance {inst.name}. "
        "Re-run `mlx-watchdog install launchd` to change it; "
        "`mlx-watchdog uninstall launchd` removes it."
    )
    unit_dir = inst.layout.unit_dir
    return {
        plist_path(unit_dir, server_label(inst.name)): dump_plist(server_plist(inst), comment),
        plist_path(unit_dir, watchdog_label(inst.name)): dump_plist(watchdog_plist(inst), comment),
        inst.config_path: watchdog_config_toml(inst, restart_action(inst)).encode(),
    }


def newsyslog_conf(inst: Instance, owner: Optional[str] = None) -> str:
    """newsyslog.conf(5) lines for the four launchd logs of inst: rotate at
    NEWSYSLOG_SIZE_KB, keep NEWSYSLOG_COUNT, compressed (J), new files owned by
    the user (a root-owned new log would stop the job from writing it), and
    no signal (N: nobody reopens on one). A job keeps writing into the file it
    opened until launchd starts it again, which a restart of the server does."""
    if owner is None:
        import grp
        import pwd

        user = pwd.getpwuid(os.getuid())
        owner = f"{user.pw_name}:{grp.getgrgid(user.pw_gid).gr_name}"
    log_dir = _log_dir(inst)
    lines = ["# logfilename  [owner:group]  mode  count  size(KB)  when  flags"]
    for stem in (inst.name, f"{inst.name}.watchdog"):
        for stream in ("out", "err"):
            lines.append(f"{log_dir / f'{stem}.{stream}.log'}  {owner}  640  "
                         f"{NEWSYSLOG_COUNT}  {NEWSYSLOG_SIZE_KB}  *  NJ")
    return "\n".join(lines) + "\n"


NEWSYSLOG_COUNT = 5
NEWSYSLOG_SIZE_KB = 10240


# ---- launchctl command lines ----

def domain(uid: int) -> str:
    return defaults.LAUNCHD_DOMAIN.format(uid=uid)


def service_target(uid: int, label: str) -> str:
    return f"{domain(uid)}/{label}"


def print_argv(uid: int, label: str) -> List[str]:
    return ["launchctl", "print", service_target(uid, label)]


def bootout_argv(uid: int, label: str) -> List[str]:
    return ["launchctl", "bootout", service_target(uid, label)]


def bootstrap_argv(uid: int, plist: Path) -> List[str]:
    return ["launchctl", "bootstrap", domain(uid), str(plist)]


def labels(name: str) -> List[str]:
    """Load order: server first; unload in reverse (watchdog first, so it does
    not restart a server that is being stopped)."""
    return [server_label(name), watchdog_label(name)]


# ---- the backend (backend.ServiceBackend) ----

class LaunchdBackend:
    manager = "launchd"
    supports_system = False
    root_warning = ("launchd agents of root (gui/0) rarely run: install as the user who is "
                    "logged in")

    def service_names(self, name: str) -> List[str]:
        return labels(name)

    def definition_paths(self, unit_dir: Path, name: str) -> List[Path]:
        return [plist_path(unit_dir, label) for label in labels(name)]

    def standard_layout(self, *, home: Path, system: bool,
                        environ: Mapping[str, str]) -> Layout:
        support = home / "Library" / "Application Support" / "mlx-watchdog"
        return Layout(home / "Library" / "LaunchAgents", support, support,
                      home / "Library" / "Logs" / "mlx-watchdog")

    def check_executable(self, path: str) -> None:
        pass  # ProgramArguments is a list: any path will do

    render = staticmethod(render)
    restart_action = staticmethod(restart_action)

    def load(self, plan: "Plan", runner: "Runner") -> None:
        # A re-install unloads the old jobs first, then loads the new.
        self._bootout(plan.inst.name, plan.uid, runner, wait=True)
        for plist in self.definition_paths(plan.inst.layout.unit_dir, plan.inst.name):
            runner.step(bootstrap_argv(plan.uid, plist))

    def unload(self, name: str, *, system: bool, uid: int, runner: "Runner",
               definitions_present: bool) -> None:
        self._bootout(name, uid, runner, wait=False)

    def after_removal(self, *, system: bool, runner: "Runner") -> None:
        pass

    def installed_notes(self, inst: Instance) -> List[str]:
        conf = f"/etc/newsyslog.d/mlx-watchdog-{inst.name}.conf"
        return [f"logs: {inst.layout.log_dir}/{inst.name}.{{out,err}}.log (and "
                f"{inst.name}.watchdog.{{out,err}}.log)",
                "log rotation: launchd never rotates them; have newsyslog do it:\n"
                f"  sudo tee {conf} <<'EOF'\n{newsyslog_conf(inst)}EOF"]

    @staticmethod
    def _bootout(name: str, uid: int, runner: "Runner", *, wait: bool) -> None:
        """Boot out the loaded jobs, the watchdog first (so that it does not
        restart the server while it is being stopped)."""
        for label in reversed(labels(name)):
            if runner.dry_run:
                runner.show(bootout_argv(uid, label), "only if loaded")
            elif runner.succeeds(print_argv(uid, label)):
                runner.run(bootout_argv(uid, label))
                if wait:
                    _wait_unloaded(uid, label, runner)


def _wait_unloaded(uid: int, label: str, runner: "Runner", timeout: float = 10.0) -> None:
    # bootout can return before launchd has forgotten the job; bootstrapping
    # it again too early fails with "Bootstrap failed: 5: Input/output error".
    deadline = time.monotonic() + timeout
    while runner.succeeds(print_argv(uid, label)) and time.monotonic() < deadline:
        time.sleep(0.2)
