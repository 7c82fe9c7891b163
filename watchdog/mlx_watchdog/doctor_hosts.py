"""`mlx-watchdog doctor --hostfile`: would a group over these hosts serve?

One check per finding, as (status, message, fix): the hostfile reads; every
other host answers ssh the way mlx.launch reaches it (no password prompt);
on every host (this one too) the server's Python runs, with mlx, mlx-lm and
the shim at the path the remote ranks will be given; every host runs the
same mlx and mlx-lm releases; and no macOS host is set to sleep when idle,
which would make it look dead to the group: the ring loses the peer, the
group restarts, and the restart cannot reach the sleeping host.

The sleep settings are read from `pmset -g` ("System-wide power settings:"
then one ` name  value [(note)]` line per setting; see man pmset(1), -g).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

from .group_hosts import LOCAL_HOST, GroupError, is_this_machine, read_hosts
from .group_ssh import Runner, ssh_check_argv, unreachable_hosts

OK, WARN, FAIL = "ok", "warn", "fail"
Check = Tuple[str, str, Optional[str]]  # (status, message, how to fix it or None)

# Runs on each host in the server's Python; one JSON line. pmset only on macOS.
_PROBE = r"""
import importlib.metadata as m, json, os, subprocess, sys
out = {"platform": sys.platform}
for d in ("mlx", "mlx-lm"):
    try:
        out[d] = m.version(d)
    except Exception:
        out[d] = None
out["shim"] = os.path.isfile(os.path.join(os.environ.get("SHIM", ""), "mlx_hotfix", "__init__.py"))
if sys.platform == "darwin":
    try:
        out["pmset"] = subprocess.run(["pmset", "-g"], capture_output=True, text=True,
                                      timeout=20).stdout
    except Exception as exc:
        out["pmset_error"] = str(exc)
print("MLX-DOCTOR-HOST " + json.dumps(out))
"""

_SETTING = re.compile(r"^\s*(?P<name>\S.*?)\s+(?P<value>\S+)(?:\s+\((?P<note>.*)\))?\s*$")


def pmset_settings(text: str) -> Dict[str, Tuple[str, Optional[str]]]:
    """`pmset -g` as {setting: (value, note)}; note is pmset's parenthesis
    ("sleep prevented by sharingd, powerd"), None without one."""
    settings: Dict[str, Tuple[str, Optional[str]]] = {}
    for line in text.splitlines():
        if not line.startswith(" "):
            continue  # "System-wide power settings:", "Currently in use:", ...
        match = _SETTING.match(line)
        if match:
            settings.setdefault(match["name"], (match["value"], match["note"]))
    return settings


def sleep_checks(host: str, pmset_output: str) -> List[Check]:
    """A macOS host that sleeps when idle looks dead to its group."""
    settings = pmset_settings(pmset_output)
    if "sleep" not in settings:
        return [(WARN, f"{host}: cannot read the sleep settings from `pmset -g`",
                 f"check by hand on {host}: pmset -g | grep sleep")]
    value, note = settings["sleep"]
    if value == "0":
        return [(OK, f"{host}: never sleeps when idle (pmset sleep 0)", None)]
    held = f"; for now {note}, which lets go when they end" if note else ""
    return [(FAIL, f"{host}: sleeps after {value} idle minute(s) (pmset sleep {value}{held}): "
                   "a sleeping host looks dead to the group, which then cannot restart",
             f"on {host}: sudo pmset -a sleep 0 (System Settings > Energy: prevent automatic "
             "sleeping)")]


def check_hosts(path: str, *, python: Optional[str] = None, shim_path: Optional[str] = None,
                run: Runner = subprocess.run) -> List[Check]:
    """Every check of serving from this hostfile (see the module docstring).

    python: the interpreter every rank runs (mlx.launch runs the same path on
    every host; default: this one). shim_path: the shim folder remote ranks
    get (--remote-shim-path; default: this installation's, the same path
    everywhere).
    """
    try:
        hosts, _ = read_hosts(path)
    except GroupError as exc:
        return [(FAIL, str(exc), "write mlx.launch's hostfile: "
                 '[{"ssh": "studio-1", "ips": ["10.0.0.1"]}, ...], rank 0 first')]
    python = python or sys.executable
    from .shim import shim_dir

    try:
        local_shim = str(shim_dir())  # local ranks inherit it on PYTHONPATH
    except FileNotFoundError as exc:
        return [(FAIL, str(exc), "reinstall mlx-watchdog")]
    shim_path = shim_path or local_shim
    names: List[str] = []
    for host in hosts:
        name = LOCAL_HOST if is_this_machine(host.ssh) else host.ssh
        if name not in names:
            names.append(name)
    checks: List[Check] = [(OK, f"hostfile {path}: {len(hosts)} ranks on "
                                f"{', '.join(h.ssh for h in hosts)}", None)]
    remote = [n for n in names if n != LOCAL_HOST]
    unreachable = set()
    for problem in unreachable_hosts(remote, run=run):
        host = problem.split(":", 1)[0]
        if host not in remote:  # ssh itself is missing: no host is reachable
            unreachable.update(remote)
            checks.append((FAIL, problem, "install OpenSSH's client (ssh)"))
            continue
        unreachable.add(host)
        checks.append((FAIL, problem, f"ssh-copy-id {host} (key login), then "
                                      f"`ssh -o BatchMode=yes {host} true` must work"))
    releases: Dict[str, Tuple[Optional[str], Optional[str]]] = {}
    for name in names:
        if name in unreachable:
            continue
        if name != LOCAL_HOST:
            checks.append((OK, f"{name}: reachable by ssh", None))
        shim = local_shim if name == LOCAL_HOST else shim_path
        found = _probe(name, python, shim, run)
        if found is None:
            checks.append((FAIL, f"{name}: cannot run {python} there",
                           f"install the server's Python at {python} on {name}: mlx.launch "
                           "runs the same path on every host"))
            continue
        if not found.get("mlx-lm") or not found.get("mlx"):
            checks.append((FAIL, f"{name}: mlx or mlx-lm is not installed for {python}",
                           f"on {name}: {python} -m pip install mlx mlx-lm"))
        releases[name] = (found.get("mlx"), found.get("mlx-lm"))
        if found.get("shim"):
            checks.append((OK, f"{name}: the hotfix shim is at {shim}", None))
        else:
            checks.append((FAIL, f"{name}: no hotfix shim at {shim}",
                           f"install mlx-watchdog on {name}, or pass its shim folder there "
                           "(`mlx-watchdog shim-path` on that host) with --remote-shim-path"))
        if found.get("platform") == "darwin":
            checks += sleep_checks(name, found.get("pmset") or "")
    if len(set(releases.values())) > 1:
        listing = "; ".join(f"{n}: mlx {v[0]}, mlx-lm {v[1]}" for n, v in releases.items())
        checks.append((FAIL, f"the hosts run different releases ({listing})",
                       "install the same mlx and mlx-lm on every host: every rank must "
                       "run the same code"))
    elif releases:
        mlx, lm = next(iter(releases.values()))
        checks.append((OK, f"every host runs mlx {mlx}, mlx-lm {lm}", None))
    return checks


def _probe(name: str, python: str, shim_path: str, run: Runner) -> Optional[dict]:
    script = f"SHIM={shlex.quote(shim_path)} {shlex.quote(python)} -c {shlex.quote(_PROBE)}"
    argv = ["bash", "-c", script] if name == LOCAL_HOST else ssh_check_argv(name, script)
    try:
        result = run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in reversed((result.stdout or "").splitlines()):
        if line.startswith("MLX-DOCTOR-HOST "):
            try:
                return json.loads(line[len("MLX-DOCTOR-HOST "):])
            except ValueError:
                return None
    return None
