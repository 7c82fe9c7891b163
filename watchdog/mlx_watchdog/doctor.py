"""`mlx-watchdog doctor`: what would go wrong if a server started here.

A list of check groups (GROUPS), each a function of the Context that returns
its checks; a check is (status, message, fix): OK (✓), WARN (!) or FAIL (✗),
and for anything but OK the command or step that fixes it. doctor exits 1
when any check fails; warnings are things to know, not errors.

Groups: the server's Python (which interpreter, the mlx-lm, mlx and
transformers releases and whether they are a known-bad pair:
sitecustomize/mlx_hotfix/pairings.py, shared with the shim), the hotfix shim
(which of its parts apply there: the shim's own registry, run in that
interpreter), the model, the port, the heartbeat and report folders, and the
service manager (systemd user lingering, launchd). Another group (a hostfile
of a distributed group, say) is one more function appended to GROUPS.

The default Python is the one behind the `mlx_lm.server` on PATH (what a
person would start); without one, this interpreter if it has mlx_lm, else
doctor asks for --python.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import click

from .defaults import HEARTBEAT_ENV, HOST, PORT, REPORT_DIR_ENV
from .log import colour_wanted
from .shim import load_shim_file, shim_dir

OK, WARN, FAIL = "ok", "warn", "fail"
SYMBOLS = {OK: "✓", WARN: "!", FAIL: "✗"}
_COLOURS = {OK: "green", WARN: "yellow", FAIL: "red"}


@dataclass(frozen=True)
class Check:
    status: str  # OK, WARN or FAIL
    message: str
    fix: Optional[str] = None  # what to do about it (not for OK)


@dataclass
class Group:
    title: str
    checks: List[Check] = field(default_factory=list)

    def ok(self, message: str) -> None:
        self.checks.append(Check(OK, message))

    def warn(self, message: str, fix: Optional[str] = None) -> None:
        self.checks.append(Check(WARN, message, fix))

    def fail(self, message: str, fix: Optional[str] = None) -> None:
        self.checks.append(Check(FAIL, message, fix))


@dataclass
class Context:
    """What the checks look at: the server's Python (and how it was chosen),
    its bind address, model, the environment, and what inspecting that
    Python found (filled in by the first group)."""

    python: Optional[str]
    python_source: str
    host: str
    port: int
    model: Optional[str]
    environ: Mapping[str, str]
    hostfile: Optional[str] = None  # an mlx.launch group's hosts, checked too
    remote_shim_path: Optional[str] = None  # the shim folder on the other hosts
    found: Dict[str, object] = field(default_factory=dict)


# Runs in the server's interpreter with the shim first on PYTHONPATH.
_INSPECT = r"""
import json, os, sys
out = {"python": sys.executable}
try:
    from importlib.metadata import version
except ImportError:
    version = None
for name in ("mlx-lm", "mlx", "transformers"):
    try:
        out[name] = version(name)
    except Exception:
        out[name] = None
try:
    import mlx_lm.server
    from mlx_hotfix import patches
    out["parts"] = dict(patches.status)
    out["status_line"] = patches.status_line()
except BaseException as exc:
    out["import_error"] = "%s: %s" % (exc.__class__.__name__, exc)
print("MLX-DOCTOR " + json.dumps(out))
"""


def _pairings():
    return load_shim_file("pairings")


def default_python(environ: Mapping[str, str]) -> Tuple[Optional[str], str]:
    """(the server's Python, how it was found): the interpreter of the
    `mlx_lm.server` on PATH, else this one if it has mlx_lm, else None."""
    script = shutil.which("mlx_lm.server", path=environ.get("PATH"))
    if script:
        python = _script_interpreter(script)
        if python:
            return python, f"the Python of the mlx_lm.server on PATH, {script}"
    if importlib.util.find_spec("mlx_lm") is not None:
        return sys.executable, "this Python: no mlx_lm.server on PATH, and it has mlx_lm"
    return None, "no mlx_lm.server on PATH"


def _script_interpreter(script: str) -> Optional[str]:
    """The interpreter in a console script's #! line (a venv's bin/python)."""
    try:
        with open(script, "rb") as handle:
            first = handle.readline(4096).decode(errors="replace").strip()
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    words = first[2:].split()
    if words and os.path.basename(words[0]) == "env" and len(words) > 1:
        return shutil.which(words[1])
    if words and os.path.isfile(words[0]):
        return words[0]
    # A venv's bin/python next to the script, when the #! is a wrapper.
    sibling = os.path.join(os.path.dirname(script), "python")
    return sibling if os.path.isfile(sibling) else None


# -- the groups -----------------------------------------------------------------


def python_group(ctx: Context) -> Group:
    group = Group("Server Python")
    if ctx.python is None:
        group.fail(f"which Python runs the server? {ctx.python_source}",
                   "give --python /path/to/venv/bin/python (the venv with mlx-lm), or put its "
                   "bin folder on PATH")
        return group
    group.ok(f"{ctx.python} ({ctx.python_source})")
    shim = str(shim_dir())
    env = dict(ctx.environ, PYTHONPATH=os.pathsep.join(
        [shim] + [p for p in ctx.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.setdefault("HF_HUB_OFFLINE", "1")
    try:
        run = subprocess.run([ctx.python, "-c", _INSPECT], env=env, capture_output=True,
                             text=True, timeout=180)
    except (OSError, subprocess.TimeoutExpired) as exc:
        group.fail(f"cannot run {ctx.python}: {getattr(exc, 'strerror', None) or exc}",
                   "give --python the path of a Python interpreter")
        return group
    lines = [line for line in run.stdout.splitlines() if line.startswith("MLX-DOCTOR ")]
    if not lines:
        said = (run.stderr.strip() or run.stdout.strip())[-300:]
        what = f"it said: {said}" if said else f"it printed nothing and exited {run.returncode}"
        group.fail(f"cannot inspect {ctx.python}: {what}",
                   "give --python the path of a Python interpreter (a venv's bin/python)")
        return group
    found = json.loads(lines[-1][len("MLX-DOCTOR "):])
    ctx.found.update(found)
    if not found.get("mlx-lm"):
        group.fail(f"mlx-lm is not installed for {ctx.python}",
                   f"{ctx.python} -m pip install mlx-lm (or give --python the venv that has it)")
        return group
    versions = ", ".join(f"{name} {found[name]}" for name in ("mlx-lm", "mlx", "transformers")
                         if found.get(name))
    group.ok(versions)
    for problem in _pairings().problems(found["mlx-lm"], found.get("mlx"),
                                        found.get("transformers")):
        # "<what>; fix: <fix>" or "<what>; <what to do>" (pairings.problems)
        what, _, fix = problem.rpartition("; ")
        group.fail(what or problem, fix.removeprefix("fix: ") or None)
    if found.get("import_error"):
        group.fail(f"import mlx_lm.server fails: {found['import_error']}",
                   "repair that venv (pip install --force-reinstall mlx-lm)")
    return group


def shim_group(ctx: Context) -> Group:
    group = Group("Hotfix shim")
    shim = str(shim_dir())
    entries = [p for p in ctx.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    on_path = any(os.path.abspath(p) == shim or (Path(p) / "mlx_hotfix" / "__init__.py").is_file()
                  for p in entries)
    ctx.found["shim_on_pythonpath"] = on_path
    if on_path:
        group.ok(f"on this shell's PYTHONPATH ({shim})")
    else:
        group.warn(f"{shim} (not on this shell's PYTHONPATH: supervise, exec and install put it "
                   "on the server's; a server you start by hand runs without it)",
                   'PYTHONPATH="$(mlx-watchdog shim-path)" mlx_lm.server ..., or '
                   "mlx-watchdog exec -- mlx_lm.server ...")
    for name, state in (ctx.found.get("parts") or {}).items():
        if name == "exit" and not str(state).startswith("applied"):
            group.fail(f"exit {state}: a dead generation thread would leave a zombie",
                       "use a tested mlx-lm release (see ARCHITECTURE.md, 'Patches by release')")
        elif str(state).startswith("applied") or name in ("extend", "recover"):
            group.ok(f"{name} {state}")
        else:
            group.warn(f"{name} {state}")
    return group


def model_group(ctx: Context) -> Group:
    group = Group("Model")
    if not ctx.model:
        group.warn("no --model given: not checked", "mlx-watchdog doctor --model PATH")
        return group
    from .install.hostcheck import looks_like_local_path

    if not looks_like_local_path(ctx.model):
        group.warn(f"{ctx.model}: not a local path; the server fetches it from the Hugging Face "
                   "hub at start (a download of gigabytes, and no start without a network)",
                   "download it once and give the folder: --model ~/models/NAME")
        return group
    path = Path(os.path.expanduser(ctx.model)).resolve()
    if not path.exists():
        group.fail(f"{ctx.model}: no such file or directory (the server would die at every "
                   "start)", "give the folder that holds the model's config.json")
    elif not (path / "config.json").is_file():
        group.fail(f"{path} has no config.json: not a model folder",
                   "give the folder that holds the model's config.json and weights")
    else:
        group.ok(f"{path} (config.json found)")
    return group


def port_group(ctx: Context) -> Group:
    from .install.hostcheck import check_port_free
    from .install.instance import FlagError

    group = Group("Network")
    shown = f"[{ctx.host}]" if ":" in ctx.host else ctx.host
    try:
        check_port_free(ctx.host, ctx.port)
    except FlagError as exc:
        fix = ("choose another --port, or stop what holds it (lsof -nP -iTCP:%d -sTCP:LISTEN)"
               % ctx.port if exc.flag == "--port" else "give --host an address of this machine")
        group.fail(f"{shown}:{ctx.port}: {exc.message}", fix)
    else:
        group.ok(f"{shown}:{ctx.port} is free")
    return group


def folders_group(ctx: Context) -> Group:
    from .reports import report_dir

    group = Group("Files")
    folders = {"crash reports": report_dir(ctx.environ.get(REPORT_DIR_ENV) or None)}
    if ctx.environ.get(HEARTBEAT_ENV):
        folders["heartbeat"] = Path(ctx.environ[HEARTBEAT_ENV]).parent
    for label, folder in folders.items():
        why = _writable(folder)
        if why:
            group.fail(f"{label}: {why}", f"make {folder} writable by this user, or set "
                       "MLX_HOTFIX_REPORT_DIR / --report-dir to a folder that is")
        else:
            group.ok(f"{label}: {folder} is writable")
    ctx.found["folders"] = {k: str(v) for k, v in folders.items()}
    return group


def service_group(ctx: Context) -> Group:
    group = Group("Service manager")
    if sys.platform == "darwin":
        if shutil.which("launchctl", path=ctx.environ.get("PATH")):
            group.ok("launchd: launchctl found (mlx-watchdog install launchd)")
        else:
            group.fail("launchctl not found on PATH", "PATH=/bin:/usr/bin:$PATH")
        agents = Path.home() / "Library" / "LaunchAgents"
        why = _writable(agents)
        if why:
            group.fail(f"LaunchAgents: {why}", f"mkdir -p {agents}")
        group.warn("launchd never rotates the services' log files",
                   "install prints a newsyslog recipe (/etc/newsyslog.d/)")
        return group
    if not shutil.which("systemctl", path=ctx.environ.get("PATH")):
        group.warn("no systemctl: `install systemd` cannot load services here",
                   "run the server under `mlx-watchdog supervise` (or in a container)")
        return group
    group.ok("systemd: systemctl found (mlx-watchdog install systemd)")
    from .install.hostcheck import linger_note

    note = linger_note()
    if note:
        group.warn("user services stop at logout and do not start at boot (no lingering)",
                   note.rsplit(": ", 1)[-1])
    else:
        group.ok("lingering is on: user services run without a login")
    return group


def count_servers() -> int:
    """How many mlx_lm servers run on this machine now (psutil)."""
    import psutil

    count = 0
    for process in psutil.process_iter(["cmdline"]):
        words = process.info.get("cmdline") or []
        line = " ".join(words)
        if "mlx_lm.server" in line or "mlx_lm server" in line or (
                "mlx_lm" in words and "server" in words):
            count += 1
    return count


def mac_memory_checks(group: Group, *, runner=None, platform: Optional[str] = None,
                      servers: Callable[[], int] = count_servers) -> None:
    """macOS: pmset settings that will sleep a server, and the sum of the
    servers' wired limits against RAM (six servers each wiring 75% of RAM
    hung three of them: mlx-lm PR #1252)."""
    from . import macos
    from .memory import format_bytes

    runner = runner or macos.run
    problems = macos.sleep_problems(macos.pmset_settings(runner=runner, platform=platform))
    for problem in problems:
        # "<what>; `<fix>`" or "<what>, or run `<fix>`": the fix is the last command
        what, _, fix = problem.rpartition("; ")
        group.warn(what or problem, fix or None)
    if not problems:
        group.ok("pmset: the Mac does not sleep while idle (or sleep is held off for good)")
    machine = macos.machine(runner=runner, platform=platform)
    per_server = machine.gpu_wired_limit_bytes or machine.recommended_working_set
    if not machine.ram_bytes or not per_server:
        group.ok("wired memory: the GPU wired cap is unknown here (not checked)")
        return
    running = servers()
    total = (running + 1) * per_server  # the running ones, and the one about to start
    line = (f"wired memory: {running} mlx_lm server(s) running, and this one: each may wire "
            f"up to {format_bytes(per_server)}, {format_bytes(total)} in all, against "
            f"{format_bytes(machine.ram_bytes)} of RAM")
    if running and total > machine.ram_bytes:
        group.warn(line + ": servers that wire more than the RAM between them hang (mlx-lm "
                   "PR #1252)",
                   "run fewer servers on this Mac, or give each a --memory-limit that fits "
                   "(their sum under the RAM), or lower the cap: sudo sysctl "
                   "iogpu.wired_limit_mb=N")
    else:
        group.ok(line)


def memory_group(ctx: Context) -> Optional[Group]:
    """macOS only: sleep and wired memory."""
    if sys.platform != "darwin":
        return None
    group = Group("Sleep and memory (macOS)")
    mac_memory_checks(group)
    return group


def hosts_group(ctx: Context) -> Optional[Group]:
    """With --hostfile: every host of the group (doctor_hosts.py)."""
    if ctx.hostfile is None:
        return None
    from .doctor_hosts import check_hosts

    checks = check_hosts(ctx.hostfile, python=ctx.python, shim_path=ctx.remote_shim_path)
    return Group(f"hosts ({ctx.hostfile})", [Check(*check) for check in checks])


#: The checks, in order; each function returns one Group, or None when it has
#: nothing to check here (more may be appended).
GROUPS: List[Callable[[Context], Optional[Group]]] = [
    python_group, shim_group, model_group, port_group, folders_group, service_group,
    memory_group, hosts_group,
]


def _writable(folder: Path) -> Optional[str]:
    """None if a file can be written in folder (made if missing), else why not."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".doctor-"):
            pass
        return None
    except OSError as exc:
        return f"{folder} is not writable ({exc.strerror or exc})"


def diagnose(python: Optional[str], host: str = HOST, port: int = PORT,
             model: Optional[str] = None, environ: Optional[Mapping[str, str]] = None,
             hostfile: Optional[str] = None, remote_shim_path: Optional[str] = None) -> dict:
    """Run every group; the findings as a dict (also what --json prints)."""
    environ = dict(os.environ if environ is None else environ)
    if python is None:
        python, source = default_python(environ)
    else:
        source = "--python"
    ctx = Context(python=python, python_source=source, host=host, port=port, model=model,
                  environ=environ, hostfile=hostfile, remote_shim_path=remote_shim_path)
    groups = [g for g in (check(ctx) for check in GROUPS) if g is not None]
    counts = {status: sum(c.status == status for g in groups for c in g.checks)
              for status in (OK, WARN, FAIL)}
    found = ctx.found
    return {
        "python": python, "mlx_lm": found.get("mlx-lm"), "mlx": found.get("mlx"),
        "transformers": found.get("transformers"),
        "shim_on_pythonpath": bool(found.get("shim_on_pythonpath")),
        "parts": found.get("parts") or {}, "folders": found.get("folders") or {},
        "host": host, "port": port, "model": model,
        "groups": [{"title": g.title, "checks": [vars(c) for c in g.checks]} for g in groups],
        "hosts": [vars(c) for g in groups if g.title.startswith("hosts (") for c in g.checks],
        "problems": [c.message for g in groups for c in g.checks if c.status == FAIL],
        "warnings": [c.message for g in groups for c in g.checks if c.status == WARN],
        "counts": counts, "ok": counts[FAIL] == 0,
    }


def format_report(report: dict, colour: bool = False) -> str:
    def mark(status: str) -> str:
        symbol = SYMBOLS[status]
        return click.style(symbol, fg=_COLOURS[status], bold=True) if colour else symbol

    lines = []
    for group in report["groups"]:
        lines.append(click.style(group["title"], bold=True) if colour else group["title"])
        for check in group["checks"]:
            lines.append(f"  {mark(check['status'])} {check['message']}")
            if check.get("fix") and check["status"] != OK:
                lines.append(f"      fix: {check['fix']}")
        lines.append("")
    counts = report["counts"]
    if counts[FAIL]:
        verdict = f"{counts[FAIL]} problem(s) to fix before a server runs here"
    elif counts[WARN]:
        verdict = "no problems; read the warnings"
    else:
        verdict = "no problems found"
    lines.append(f"{verdict} ({counts[OK]} ok, {counts[WARN]} warning(s), "
                 f"{counts[FAIL]} problem(s))")
    return "\n".join(lines)


@click.command("doctor")
@click.option("--python", "python", default=None,
              help="The interpreter the server would run with. [default: the Python of the "
                   "mlx_lm.server on PATH, else this one if it has mlx_lm]")
@click.option("--host", default=HOST, show_default=True, help="The server's --host.")
@click.option("--port", default=PORT, show_default=True, type=click.IntRange(1, 65535),
              help="The server's --port.")
@click.option("--model", default=None, help="The server's --model: a folder is checked.")
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
@click.option("--hostfile", default=None, type=click.Path(dir_okay=False),
              help="An mlx.launch group's hostfile: also check every host (ssh, the same "
              "mlx and mlx-lm, the shim, macOS sleep settings).")
@click.option("--remote-shim-path", default=None,
              help="With --hostfile: the shim folder on the other hosts. "
              "[default: the same path as here]")
@click.option("--no-color", "no_color", is_flag=True,
              help="No colour even on a terminal (so does a set NO_COLOR variable).")
@click.pass_context
def doctor_command(ctx: click.Context, python: Optional[str], host: str, port: int,
                   model: Optional[str], as_json: bool, hostfile: Optional[str],
                   remote_shim_path: Optional[str], no_color: bool) -> None:
    """Check the environment a server would run in: ✓ fine, ! worth knowing,
    ✗ a problem (each with its fix). Exits 1 when there is a problem."""
    report = diagnose(python, host, port, model, hostfile=hostfile,
                      remote_shim_path=remote_shim_path)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        colour = colour_wanted(no_color)
        click.echo(format_report(report, colour=colour))
    ctx.exit(0 if report["ok"] else 1)
