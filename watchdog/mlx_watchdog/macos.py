"""What the Mac says about memory and sleep: readers that import, and fall
back, everywhere.

Each reader has a pure parser (tested with the real formats as data) and a
thin call that runs only on macOS and returns None (or an empty answer)
elsewhere, so Linux runs the fallbacks:

- ``footprint(pid)``: proc_pid_rusage(pid, RUSAGE_INFO_V4) for any process
  of ours: phys_footprint, resident and wired size. The struct lives in the
  shim's footprint.py, loaded here by path (as doctor.py loads pairings.py),
  so there is one copy of Apple's layout.
- ``sysctl(name)``: ``/usr/sbin/sysctl -n NAME`` (sysctl(8)); ``ram_bytes``
  reads ``hw.memsize`` (psutil elsewhere), ``gpu_wired_limit_bytes``
  ``iogpu.wired_limit_mb`` (macOS 14 and later; 0 means the default cap) or
  ``debug.iogpu.wired_limit`` (bytes; macOS 13).
- ``wired_bytes()``: the machine's wired memory from ``vm_stat`` ("Pages
  wired down" times the page size its first line gives; vm_stat(1), Apple's
  system_cmds vm_stat.c).
- ``find_jetsam(pid)``: the newest ``/Library/Logs/DiagnosticReports/
  JetsamEvent-*.ips`` that names the pid as killed. An .ips file is one JSON
  header line (``bug_type`` "298" for a jetsam event) then a JSON body with
  ``largestProcess``, ``memoryStatus`` (``pageSize``, ``memoryPages``) and
  ``processes``; a killed process has ``reason`` (XNU's
  ``memorystatus_kill_cause_name``: ``per-process-limit``,
  ``vm-compressor-space-shortage``, ``highwater``, ...), ``pid``, ``name``
  and ``rpages`` (resident pages).
- ``pmset_settings()`` / ``sleep_problems(settings)``: ``pmset -g``'s
  "Currently in use" settings, and those that will sleep a server.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from .memory import Machine, format_bytes

Runner = Callable[[Sequence[str]], Optional[str]]  # argv -> stdout, or None on failure
DIAGNOSTIC_REPORTS = Path("/Library/Logs/DiagnosticReports")
JETSAM_GLOB = "JetsamEvent-*.ips"
JETSAM_FILES = 5  # the newest files looked at
MAX_IPS_BYTES = 16 << 20


def is_macos(platform: Optional[str] = None) -> bool:
    return (platform or sys.platform) == "darwin"


def run(argv: Sequence[str], timeout: float = 10.0) -> Optional[str]:
    """stdout of argv, or None if it could not run or failed (C locale)."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, LC_ALL="C"), stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


# -- footprint -----------------------------------------------------------------------

_footprint_module = None


def _footprint_reader():
    global _footprint_module
    if _footprint_module is None:
        from .shim import shim_dir

        path = shim_dir() / "mlx_hotfix" / "footprint.py"
        spec = importlib.util.spec_from_file_location("mlx_watchdog_footprint", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _footprint_module = module
    return _footprint_module


def footprint(pid: int) -> Optional[Dict[str, int]]:
    """{"phys_footprint", "resident_size", "wired_size", "lifetime_max_phys_footprint"}
    of process pid in bytes, or None (not macOS, gone, or not ours to read)."""
    if not is_macos():
        return None
    try:
        return _footprint_reader().read(pid)
    except Exception:  # noqa: BLE001 - a missing reading, never a failed tick
        return None


# -- sysctl --------------------------------------------------------------------------------


def sysctl(name: str, *, runner: Runner = run, platform: Optional[str] = None) -> Optional[str]:
    """The value of sysctl name (macOS), or None."""
    if not is_macos(platform):
        return None
    out = runner(["/usr/sbin/sysctl", "-n", name])
    return out.strip() if out and out.strip() else None


def _int(text: Optional[str]) -> Optional[int]:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def ram_bytes(*, runner: Runner = run, platform: Optional[str] = None) -> Optional[int]:
    if is_macos(platform):
        return _int(sysctl("hw.memsize", runner=runner, platform=platform))
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001
        return None


def gpu_wired_limit_bytes(*, runner: Runner = run,
                          platform: Optional[str] = None) -> Optional[int]:
    """The GPU wired-memory cap set by the user, or None (not set: macOS's
    default cap, which MLX's recommended working set reflects)."""
    megabytes = _int(sysctl("iogpu.wired_limit_mb", runner=runner, platform=platform))
    if megabytes:
        return megabytes << 20
    if megabytes is None:  # before macOS 14 the knob was this one, in bytes
        value = _int(sysctl("debug.iogpu.wired_limit", runner=runner, platform=platform))
        if value:
            return value
    return None


def recommended_working_set() -> Optional[int]:
    """MLX's max_recommended_working_set_size (Metal), when mlx is importable here."""
    try:
        import mlx.core as mx

        info = (getattr(mx, "device_info", None) or mx.metal.device_info)()
        value = info.get("max_recommended_working_set_size")
        return int(value) if value else None
    except Exception:  # noqa: BLE001 - no mlx in the watchdog's environment, no Metal
        return None


def machine(*, runner: Runner = run, platform: Optional[str] = None) -> Machine:
    """What memory_limit = auto needs to know about this machine."""
    platform = platform or sys.platform
    mac = is_macos(platform)
    return Machine(
        system=platform,
        ram_bytes=ram_bytes(runner=runner, platform=platform),
        gpu_wired_limit_bytes=gpu_wired_limit_bytes(runner=runner, platform=platform)
        if mac else None,
        recommended_working_set=recommended_working_set() if mac else None,
    )


# -- vm_stat ------------------------------------------------------------------------------

_PAGE_SIZE = re.compile(r"page size of (\d+) bytes")
_VM_LINE = re.compile(r'^"?([^:"]+)"?:\s+(\d+)\.?\s*$')


def parse_vm_stat(text: str) -> Dict[str, int]:
    """vm_stat's counters by name ("Pages wired down": pages), plus "page size"."""
    counters: Dict[str, int] = {}
    size = _PAGE_SIZE.search(text or "")
    if size:
        counters["page size"] = int(size.group(1))
    for line in (text or "").splitlines():
        match = _VM_LINE.match(line.strip())
        if match:
            counters[match.group(1).strip()] = int(match.group(2))
    return counters


def wired_from_vm_stat(text: str) -> Optional[int]:
    counters = parse_vm_stat(text)
    if "page size" not in counters or "Pages wired down" not in counters:
        return None
    return counters["Pages wired down"] * counters["page size"]


def wired_bytes(*, runner: Runner = run, platform: Optional[str] = None) -> Optional[int]:
    """The machine's wired memory in bytes (macOS), or None."""
    if not is_macos(platform):
        return None
    out = runner(["/usr/bin/vm_stat"])
    return wired_from_vm_stat(out) if out else None


# -- jetsam -------------------------------------------------------------------------------


@dataclass(frozen=True)
class JetsamKill:
    pid: int
    name: str
    reason: str  # e.g. "vm-compressor-space-shortage", "per-process-limit"
    largest_process: Optional[str]
    resident_bytes: Optional[int]  # rpages x pageSize, when both are there
    timestamp: Optional[str]  # the header's, as written
    path: str

    def describe(self) -> str:
        size = f", {format_bytes(self.resident_bytes)} resident" if self.resident_bytes else ""
        largest = f"; largest process {self.largest_process}" if self.largest_process else ""
        return (f"killed by jetsam ({self.reason}) at {self.timestamp or 'an unknown time'}: "
                f"{self.name} pid {self.pid}{size}{largest} ({self.path})")


def parse_ips(text: str) -> Optional[tuple]:
    """(header, body) of an .ips file: a JSON header line, then a JSON body."""
    head, _, rest = (text or "").partition("\n")
    try:
        header, body = json.loads(head), json.loads(rest)
    except ValueError:
        return None
    if not isinstance(header, dict) or not isinstance(body, dict):
        return None
    return header, body


def jetsam_kill_in(text: str, pid: int, path: str = "") -> Optional[JetsamKill]:
    """The kill of pid recorded in one JetsamEvent .ips text, or None."""
    parsed = parse_ips(text)
    if parsed is None:
        return None
    header, body = parsed
    if str(header.get("bug_type", "298")) != "298":
        return None
    page_size = (body.get("memoryStatus") or {}).get("pageSize")
    for process in body.get("processes") or ():
        if not isinstance(process, dict) or process.get("pid") != pid:
            continue
        reason = process.get("reason")
        if not isinstance(reason, str) or not reason:
            continue  # listed, not killed
        pages = process.get("rpages")
        resident = (pages * page_size if isinstance(pages, int) and isinstance(page_size, int)
                    else None)
        largest = body.get("largestProcess")
        return JetsamKill(pid=pid, name=str(process.get("name") or "?"), reason=reason,
                          largest_process=largest if isinstance(largest, str) else None,
                          resident_bytes=resident,
                          timestamp=header.get("timestamp") or body.get("date"), path=path)
    return None


def find_jetsam(pid: int, *, folder: Path = DIAGNOSTIC_REPORTS, since: Optional[float] = None,
                newest: int = JETSAM_FILES) -> Optional[JetsamKill]:
    """The kill of pid in the newest JetsamEvent-*.ips files (modified at or
    after since, a unix time, when given), or None. Never raises."""
    from .safefile import open_regular

    try:
        files = sorted(Path(folder).glob(JETSAM_GLOB), key=lambda p: p.stat().st_mtime,
                       reverse=True)
    except OSError:
        return None
    for path in files[:newest]:
        try:
            if since is not None and path.stat().st_mtime < since:
                break
            with os.fdopen(open_regular(path), "rb") as handle:
                text = handle.read(MAX_IPS_BYTES).decode("utf-8", "replace")
        except OSError:
            continue
        kill = jetsam_kill_in(text, pid, str(path))
        if kill is not None:
            return kill
    return None


# -- pmset -------------------------------------------------------------------------------

_PMSET_SETTING = re.compile(r"^(.*?\S)\s+(\S+)$")
_PMSET_NOTE = re.compile(r"\s*\((.*)\)\s*$")


def parse_pmset(text: str) -> Dict[str, Dict[str, str]]:
    """``pmset -g``: {section: {setting: value}} ("System-wide power settings",
    "Currently in use", ...). A setting line is the name (one word, or a few:
    "Sleep On Power Button"), blanks, the value, and maybe a note in
    parentheses ("(sleep prevented by powerd)"), kept as "<setting> note"."""
    sections: Dict[str, Dict[str, str]] = {}
    current: Optional[Dict[str, str]] = None
    for line in (text or "").splitlines():
        if not line.strip():
            continue
        if not line[:1].isspace() and line.rstrip().endswith(":"):
            current = sections.setdefault(line.strip()[:-1], {})
            continue
        if current is None:
            current = sections.setdefault("", {})
        note = _PMSET_NOTE.search(line)
        setting = _PMSET_SETTING.match(line[:note.start()].strip() if note else line.strip())
        if setting:
            current[setting.group(1)] = setting.group(2)
            if note:
                current[setting.group(1) + " note"] = note.group(1)
    return sections


def sleep_problems(sections: Dict[str, Dict[str, str]]) -> List[str]:
    """Settings that will sleep (or slow) a server, in an operator's words."""
    if sections.get("System-wide power settings", {}).get("SleepDisabled") == "1":
        return []
    settings = sections.get("Currently in use") or {}
    problems = []
    sleep = _int(settings.get("sleep"))
    if sleep:
        note = settings.get("sleep note")
        held = f" (now held off: {note})" if note else ""
        problems.append(
            f"pmset: sleep {sleep}: the Mac sleeps after {sleep} idle minute(s){held}, and a "
            "server asleep mid-generation is a hang to every client; `mlx-watchdog install "
            "launchd` keeps it awake while the server runs (caffeinate -i -s -w, unless "
            "--allow-sleep), or run `sudo pmset -a sleep 0`")
    if settings.get("lowpowermode") == "1":
        problems.append("pmset: lowpowermode 1: Low Power Mode slows generation; "
                        "`sudo pmset -a lowpowermode 0`")
    return problems


def pmset_settings(*, runner: Runner = run,
                   platform: Optional[str] = None) -> Dict[str, Dict[str, str]]:
    """``pmset -g`` parsed (macOS), else {}."""
    if not is_macos(platform):
        return {}
    out = runner(["/usr/bin/pmset", "-g"])
    return parse_pmset(out) if out else {}
