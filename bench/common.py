"""Shared helpers for the figure scripts in bench/ (see bench/README.md).

Every figure script, run from the repository root:

    <main python> -m bench.<figure> [--quick] [--results-dir DIR]

measures the shim (or the watchdog) against stock *in the same run*, and
writes ``<results-dir>/<figure>.json`` (everything measured, plus the machine
and the exact command) and ``<results-dir>/<figure>.md`` (a markdown fragment:
a heading, the tables, and a footer line with date, machine and command),
which ``bench/run_all`` stitches into ``RESULTS.md``.

This module only uses the standard library (psutil when present), so it runs
on the main env's python; the servers and probes run in the per-release venvs.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import requests

from harness import FAULTS_DIR, TINYMODEL  # noqa: F401 - FAULTS_DIR: for the figures
from harness import server as server_support
from harness.procs import kill_group

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
RESULTS_DIR = BENCH / "results"

VERSIONS = server_support.VERSIONS  # ("0.31.3", "0.32.2")
MAIN_VERSION = "0.32.2"  # its venv has this package (editable) and requests/psutil/click
SHIM_DIR = server_support.SHIM_DIR


# -- environments --------------------------------------------------------------


def env_python(version: str) -> Path:
    """The python of the venv with stock mlx-lm==version (scripts/setup-envs)."""
    return server_support.python_for(version)


def main_python() -> Path:
    return env_python(MAIN_VERSION)


def rel(path: "os.PathLike[str] | str") -> str:
    """path relative to the repo when it is inside it (for commands in reports)."""
    absolute = Path(os.path.abspath(path))
    try:
        return str(absolute.relative_to(ROOT))
    except ValueError:
        return str(path)


# -- time ------------------------------------------------------------------------


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def wall() -> float:
    """Wall-clock seconds (time.time()): comparable across processes on this host."""
    return time.time()


# -- statistics ------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default), p in [0, 100]."""
    data = sorted(values)
    if not data:
        return math.nan
    k = (len(data) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return data[lo] + (data[hi] - data[lo]) * (k - lo)


def stats(values: Iterable[float]) -> Dict[str, Any]:
    data = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not data:
        return {"n": 0, "median": None, "p90": None, "max": None, "min": None, "mean": None}
    return {
        "n": len(data),
        "median": statistics.median(data),
        "p90": percentile(data, 90),
        "max": max(data),
        "min": min(data),
        "mean": statistics.fmean(data),
    }


def linear_slope(xs: Sequence[float], ys: Sequence[float]) -> Optional[float]:
    """Least-squares slope of ys over xs (None with fewer than 2 points)."""
    if len(xs) < 2:
        return None
    mx_, my_ = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx_) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx_) * (y - my_) for x, y in zip(xs, ys)) / sxx


def fmt(value: Optional[float], unit: str = "", digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}{unit}"


def fmt_ms(seconds: Optional[float], digits: int = 0) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.{digits}f} ms"


# -- the machine -------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "processor\t: arm")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gb() -> Optional[float]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return None


def _os_name() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return platform.system()


_ENV_PROBE = (
    "import json, platform, importlib.metadata as m\n"
    "def v(n):\n"
    "    try: return m.version(n)\n"
    "    except m.PackageNotFoundError: return None\n"
    "print(json.dumps({'python': platform.python_version(), 'mlx': v('mlx'), "
    "'mlx_lm': v('mlx-lm')}))"
)


def env_versions(version: str) -> Dict[str, Any]:
    try:
        out = subprocess.run([str(env_python(version)), "-c", _ENV_PROBE], capture_output=True,
                             text=True, timeout=60, env=server_support.base_env(shim=False))
        return json.loads(out.stdout.strip().splitlines()[-1])
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        return {"error": f"{exc.__class__.__name__}: {exc}"}


def machine(versions: Sequence[str] = VERSIONS) -> Dict[str, Any]:
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": affinity,
        "ram_gb": _ram_gb(),
        "os": _os_name(),
        "kernel": platform.release(),
        "arch": platform.machine(),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "envs": {v: env_versions(v) for v in versions},
    }


def machine_line(m: Dict[str, Any]) -> str:
    envs = m.get("envs", {})
    pythons = sorted({e.get("python") for e in envs.values() if e.get("python")})
    mlx = sorted({e.get("mlx") for e in envs.values() if e.get("mlx")})
    lms = [e.get("mlx_lm") for e in envs.values() if e.get("mlx_lm")]
    load = m.get("loadavg")
    return (f"{m['cpu']}, {m['cores']} cores, {m['ram_gb']} GB RAM, {m['os']} "
            f"(Linux {m['kernel']}, {m['arch']}), Python {'/'.join(pythons)}, "
            f"mlx {'/'.join(mlx)}, mlx-lm {' and '.join(lms)}"
            + (f"; load average at start {load[0]:.2f}" if load else ""))


# -- the stamp every figure carries ---------------------------------------------------


def git_revision() -> Dict[str, Any]:
    """{"revision": short hash or None, "dirty": bool or None} of the checkout."""
    def git(*args: str) -> Optional[str]:
        try:
            out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True,
                                 text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    revision = git("rev-parse", "--short", "HEAD")
    # A run rewrites its own results files: those do not make the tree dirty.
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results")
    return {"revision": revision, "dirty": None if status is None else bool(status)}


def command_line(module: str, argv: Sequence[str]) -> str:
    """The exact command that reproduces a figure, run from the repository root."""
    return shlex.join([rel(sys.executable), "-m", module, *argv])


def stamp(module: str, argv: Sequence[str], versions: Sequence[str] = VERSIONS) -> Dict[str, Any]:
    """Revision (and whether the tree was dirty), date, machine and command of a figure."""
    return {**git_revision(), "date": now_iso(), "machine": machine(versions),
            "command": command_line(module, argv)}


def stamp_line(s: Dict[str, Any]) -> str:
    """The stamp as one markdown line, for a figure's footer."""
    revision = s.get("revision") or "unknown revision"
    if s.get("dirty"):
        revision += " (uncommitted changes)"
    return (f"git {revision}, {s['date']}. Machine: {machine_line(s['machine'])}. "
            f"Command: `{s['command']}`")


def noise_verdict(difference: Optional[float], noise: Optional[float], text: str) -> str:
    """text when |difference| exceeds the noise, else "no measurable difference".

    noise is the spread of the measurement itself (say, the larger of the two
    arms' interquartile ranges, or a repeat-to-repeat spread): a move smaller
    than that is not a result.
    """
    if difference is None or noise is None or math.isnan(difference) or math.isnan(noise):
        return "n/a"
    return text if abs(difference) > noise else "no measurable difference"


# -- cleanup of everything we start --------------------------------------------------


class Cleanup:
    """Kills, at exit or on Ctrl-C/SIGTERM, every process group registered.

    Register a Popen started with start_new_session=True (it leads its own
    group), or any object with a stop() method. Groups are killed by their
    own id only, never by name.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._items: List[Any] = []
        self._installed = False

    def install(self) -> None:
        if self._installed:
            return
        self._installed = True
        atexit.register(self.run)

        def on_term(signum, frame):  # SIGTERM/SIGHUP: unwind like Ctrl-C, then clean up
            raise KeyboardInterrupt(f"signal {signum}")

        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                signal.signal(sig, on_term)
            except (ValueError, OSError):
                pass

    def add(self, item):
        with self._lock:
            self._items.append(item)
        return item

    def discard(self, item) -> None:
        with self._lock:
            if item in self._items:
                self._items.remove(item)

    def run(self) -> None:
        with self._lock:
            items, self._items = self._items[::-1], []
        for item in items:
            try:
                if isinstance(item, subprocess.Popen):
                    kill_group(item)
                else:
                    item.stop()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass


CLEANUP = Cleanup()


# -- tiny models -----------------------------------------------------------------------


def build_model(kind: str, out_dir: Path, *, layers: Optional[int] = None,
                full_attention_interval: Optional[int] = None, seed: int = 0) -> Path:
    """Build a tiny random model with harness/tinymodel.py (main env)."""
    cmd = [str(main_python()), str(TINYMODEL), kind, str(out_dir), "--seed", str(seed)]
    if layers is not None:
        cmd += ["--layers", str(layers)]
    if full_attention_interval is not None:
        cmd += ["--full-attention-interval", str(full_attention_interval)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600,
                   env=server_support.base_env(shim=False))
    return Path(out_dir)


def temp_dir(prefix: str) -> Path:
    """A temporary directory removed at exit."""
    holder = tempfile.TemporaryDirectory(prefix=prefix)
    atexit.register(holder.cleanup)
    return Path(holder.name)


# -- the figure: arguments, progress, results ----------------------------------------------


class Figure:
    """One benchmark figure: its CLI, its log, and its results files."""

    def __init__(self, name: str, title: str, description: str = "",
                 argv: Optional[Sequence[str]] = None,
                 add_arguments: Optional[Callable[[argparse.ArgumentParser], None]] = None):
        self.name = name
        self.title = title
        parser = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=description,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("--quick", action="store_true",
                            help="fewer repetitions and smaller sizes, for development")
        parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR,
                            help="where to write <figure>.json and <figure>.md "
                                 "[default: bench/results]")
        if add_arguments:
            add_arguments(parser)
        self.argv = list(sys.argv[1:] if argv is None else argv)
        self.args = parser.parse_args(self.argv)
        self.quick: bool = self.args.quick
        self.results_dir: Path = self.args.results_dir
        self.started = now_iso()
        self._t0 = time.monotonic()
        CLEANUP.install()
        self.log(f"{self.title} ({'quick' if self.quick else 'full'} mode)")
        self.stamp = stamp(f"bench.{self.name}", self.argv)
        self.machine = self.stamp["machine"]
        self.log(machine_line(self.machine))

    def command(self) -> str:
        return self.stamp["command"]

    def log(self, message: str) -> None:
        elapsed = time.monotonic() - getattr(self, "_t0", time.monotonic())
        print(f"[{self.name} {elapsed:7.1f}s] {message}", file=sys.stderr, flush=True)

    def footer(self) -> str:
        return (f"_{'Quick' if self.quick else 'Full'} mode, {time.monotonic() - self._t0:.0f} s; "
                f"{stamp_line(self.stamp)}._")

    def write(self, results: Dict[str, Any], body_markdown: str,
              summary: Optional[Dict[str, Any]] = None) -> Path:
        """Write <figure>.json and <figure>.md atomically; returns the json path."""
        self.results_dir.mkdir(parents=True, exist_ok=True)
        finished = now_iso()
        document = {
            "figure": self.name,
            "title": self.title,
            "command": self.command(),
            "revision": self.stamp["revision"],
            "dirty": self.stamp["dirty"],
            "mode": "quick" if self.quick else "full",
            "started": self.started,
            "finished": finished,
            "duration_s": round(time.monotonic() - self._t0, 1),
            "machine": dict(self.machine, loadavg_at_end=list(os.getloadavg())),
            "summary": summary or {},
            "results": results,
        }
        markdown = f"### {self.title}\n\n{body_markdown.strip()}\n\n{self.footer()}\n"
        json_path = self.results_dir / f"{self.name}.json"
        md_path = self.results_dir / f"{self.name}.md"
        _atomic_write(json_path, json.dumps(document, indent=2, default=_json_default) + "\n")
        _atomic_write(md_path, markdown)
        self.log(f"wrote {rel(json_path)} and {rel(md_path)}")
        print(markdown)
        return json_path


def _json_default(value):
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and math.isnan(value):
        return None
    return repr(value)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def run_main(main: Callable[[], int]) -> None:
    """Run a figure's main(): exit 130 on Ctrl-C, after the cleanup ran."""
    try:
        code = main()
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        CLEANUP.run()
        code = 130
    finally:
        CLEANUP.run()
    sys.exit(code or 0)


if __name__ == "__main__":  # `python -m bench.common`: the machine, as the figures describe it
    print(machine_line(machine()))


def quiet(call: Callable[[], object]) -> None:
    """Run a background client request whose answer (or failure) nobody reads."""
    try:
        call()
    except requests.RequestException:
        pass
