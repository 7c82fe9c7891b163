"""launchd (macOS) definitions: two LaunchAgents per instance, built with plistlib.

Pure rendering functions; install_cli.py writes and loads them.

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
"""

from __future__ import annotations

import plistlib
from pathlib import Path
from typing import Dict, List, Optional

from . import defaults
from .services import LABEL_PREFIX, MARKER, Instance, watchdog_config_toml

SERVER_THROTTLE_INTERVAL = 30
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
    log_dir = _log_dir(inst)
    return {
        "Label": server_label(inst.name),
        "ProgramArguments": inst.server_argv(),
        "EnvironmentVariables": inst.server_env(),
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False, "Crashed": True},
        "ThrottleInterval": SERVER_THROTTLE_INTERVAL,
        # SIGTERM, then SIGKILL after this long: the watchdog's stop grace.
        "ExitTimeOut": SERVER_EXIT_TIMEOUT,
        "ProcessType": "Interactive",
        "StandardOutPath": str(log_dir / f"{inst.name}.out.log"),
        "StandardErrorPath": str(log_dir / f"{inst.name}.err.log"),
    }


def watchdog_plist(inst: Instance) -> dict:
    log_dir = _log_dir(inst)
    return {
        "Label": watchdog_label(inst.name),
        "ProgramArguments": inst.watchdog_argv(),
        "EnvironmentVariables": inst.watchdog_env(),
        "RunAtLoad": True,
        "KeepAlive": True,
        "ThrottleInterval": WATCHDOG_THROTTLE_INTERVAL,
        "ProcessType": "Standard",
        "StandardOutPath": str(log_dir / f"{inst.name}.watchdog.out.log"),
        "StandardErrorPath": str(log_dir / f"{inst.name}.watchdog.err.log"),
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


# ---- launchctl command lines ----

def domain(uid: int) -> str:
    return f"gui/{uid}"


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


def label_of(path: Path) -> Optional[str]:
    try:
        with open(path, "rb") as fh:
            return plistlib.load(fh).get("Label")
    except Exception:  # noqa: BLE001 - not a readable plist: no label
        return None
