"""`mlx-watchdog doctor`: what would go wrong if a server started here.

It checks the environment a server would run in (an interpreter, default
this one): the mlx-lm, mlx and transformers versions and whether they are a
known-bad pair (sitecustomize/mlx_hotfix/pairings.py, shared with the shim),
whether the shim is on PYTHONPATH, which of the shim's parts apply there (the
shim's own registry, run in that interpreter), whether the heartbeat and
report folders are writable, and whether the port is free.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import click

from .defaults import HEARTBEAT_ENV
from .shim import shim_dir

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
    path = shim_dir() / "mlx_hotfix" / "pairings.py"
    spec = importlib.util.spec_from_file_location("mlx_watchdog_pairings", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _default_report_dir() -> Path:
    if os.environ.get("MLX_HOTFIX_REPORT_DIR"):
        return Path(os.environ["MLX_HOTFIX_REPORT_DIR"])
    if sys.platform == "darwin":
        return Path.home() / "Library/Logs/mlx-watchdog/reports"
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local/state")
    return Path(state) / "mlx-watchdog" / "reports"


def _writable(folder: Path) -> Optional[str]:
    """None if a file can be written in folder (made if missing), else why not."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".doctor-"):
            pass
        return None
    except OSError as exc:
        return f"{folder} is not writable ({exc.strerror or exc})"


def _port_problem(host: str, port: int) -> Optional[str]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            return f"port {port} on {host} is taken ({exc.strerror or exc})"
    return None


def diagnose(python: str, host: str, port: int, environ=None) -> dict:
    environ = dict(os.environ if environ is None else environ)
    problems, notes = [], []
    shim = str(shim_dir())
    on_path = any(os.path.abspath(p) == shim or
                  (Path(p) / "mlx_hotfix" / "__init__.py").is_file()
                  for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p)
    if not on_path:
        problems.append("the shim is not on PYTHONPATH: start the server with "
                        "`mlx-watchdog exec -- ...` or PYTHONPATH=$(mlx-watchdog shim-path)")
    env = dict(environ, PYTHONPATH=os.pathsep.join(
        [shim] + [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.setdefault("HF_HUB_OFFLINE", "1")
    try:
        run = subprocess.run([python, "-c", _INSPECT], env=env, capture_output=True,
                             text=True, timeout=180)
        lines = [l for l in run.stdout.splitlines() if l.startswith("MLX-DOCTOR ")]
        found = json.loads(lines[-1][len("MLX-DOCTOR "):]) if lines else {}
        if not lines:
            problems.append(f"cannot inspect {python}: {run.stderr.strip()[-300:]}")
    except (OSError, subprocess.TimeoutExpired) as exc:
        found = {}
        problems.append(f"cannot run {python}: {exc}")
    if found and not found.get("mlx-lm"):
        problems.append(f"mlx-lm is not installed for {python}")
    if found.get("import_error"):
        problems.append("import mlx_lm.server fails: " + found["import_error"])
    pairing = None
    if found.get("mlx-lm"):
        pairing = _pairings().problems(found["mlx-lm"], found.get("mlx"), found.get("transformers"))
        problems.extend(pairing)
    for name, state in (found.get("parts") or {}).items():
        if name == "exit" and not state.startswith("applied"):
            problems.append(f"exit {state}: a dead generation thread would leave a zombie")
        else:
            notes.append(f"{name} {state}")
    folders = {"reports": _default_report_dir()}
    if environ.get(HEARTBEAT_ENV):
        folders["heartbeat"] = Path(environ[HEARTBEAT_ENV]).parent
    for label, folder in folders.items():
        why = _writable(folder)
        if why:
            problems.append(f"{label}: {why}")
    port_problem = _port_problem(host, port)
    if port_problem:
        problems.append(port_problem)
    return {
        "python": python, "mlx_lm": found.get("mlx-lm"), "mlx": found.get("mlx"),
        "transformers": found.get("transformers"), "shim_on_pythonpath": on_path,
        "parts": found.get("parts") or {}, "pairing": pairing or [],
        "folders": {k: str(v) for k, v in folders.items()}, "port": port,
        "problems": problems, "notes": notes, "ok": not problems,
    }


def format_report(report: dict) -> str:
    lines = [f"python        {report['python']}",
             f"mlx-lm        {report['mlx_lm']}",
             f"mlx           {report['mlx']}",
             f"transformers  {report['transformers']}",
             f"shim          {'on PYTHONPATH' if report['shim_on_pythonpath'] else 'NOT on PYTHONPATH'}"]
    for name, state in report["parts"].items():
        lines.append(f"part {name:<8} {state}")
    for folder in report["folders"].items():
        lines.append("folder %-8s %s" % folder)
    lines.append(f"port          {report['port']}")
    if report["problems"]:
        lines.append("")
        lines += [f"PROBLEM: {p}" for p in report["problems"]]
    else:
        lines.append("\nno problems found")
    return "\n".join(lines)


@click.command("doctor")
@click.option("--python", "python", default=sys.executable, show_default="this interpreter",
              help="The interpreter the server would run with.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535))
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
@click.option("--hostfile", default=None, type=click.Path(dir_okay=False),
              help="An mlx.launch group's hostfile: also check every host (ssh, the same "
              "mlx and mlx-lm, the shim, macOS sleep settings).")
@click.option("--remote-shim-path", default=None,
              help="With --hostfile: the shim folder on the other hosts. "
              "[default: the same path as here]")
@click.pass_context
def doctor_command(ctx: click.Context, python: str, host: str, port: int, as_json: bool,
                   hostfile: Optional[str], remote_shim_path: Optional[str]) -> None:
    """Check the environment a server would run in; exit 1 on any problem."""
    report = diagnose(python, host, port)
    if hostfile is not None:
        from .doctor_hosts import FAIL, check_hosts, format_checks

        checks = check_hosts(hostfile, python=python, shim_path=remote_shim_path)
        report["hosts"] = [{"status": s, "message": m, "fix": f} for s, m, f in checks]
        report["problems"] += [m for s, m, _ in checks if s == FAIL]
        report["ok"] = not report["problems"]
    text = format_report(report)
    if hostfile is not None and not as_json:
        text = f"{text}\n\nhosts ({hostfile})\n{format_checks(checks)}"
    click.echo(json.dumps(report, indent=2) if as_json else text)
    ctx.exit(0 if report["ok"] else 1)
