"""The memory guard's evidence: the limit, the measure, the shim's memory and requests.

Pure pieces, each testable alone (the judge is memory_judge.py; the macOS
readers are macos.py):

- ``parse_memory_limit`` reads ``memory_limit`` / ``--memory-limit``: bytes
  with a binary unit, as RAM is sized (``48G`` = 48 GiB, ``512M``, ``1.5T``,
  ``65536K``, plain bytes; a trailing ``B`` or ``iB`` is allowed), a share of
  RAM (``80%``), ``auto`` or ``off``. ``resolve_limit`` turns it into bytes
  for one machine: ``auto`` on macOS is the smaller of RAM minus a reserve
  (8 GiB; 4 GiB under 16 GiB of RAM) and the GPU's wired cap
  (``iogpu.wired_limit_mb`` when set, else MLX's recommended working set);
  elsewhere ``auto`` is off (no unified memory to guard: give bytes to guard
  anyway).
- ``measure`` is the number judged: ``phys_footprint`` where known (the
  watchdog's own read of the server's pid on macOS, else the heartbeat's),
  else the RSS of the server's process tree (``tree_rss``, psutil), else the
  heartbeat's RSS; never less than the heartbeat's ``mlx_active``.
- ``parse_heartbeat_memory`` validates the heartbeat's ``memory`` object
  (sitecustomize/mlx_hotfix/memory.py writes it).
- ``write_request`` writes ``<heartbeat>.memory``, the file the shim reads
  for a trim and for /health's 503 ``{"status": "memory"}``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .safefile import write_atomically

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
RESERVE_BYTES = 8 * GiB  # left to macOS and everything else on the Mac
SMALL_RAM_BYTES = 16 * GiB  # below this much RAM ...
SMALL_RESERVE_BYTES = 4 * GiB  # ... the reserve is this
REQUEST_SUFFIX = ".memory"  # <heartbeat file>.memory: the shim's request file
_UNITS = {"": 1, "K": KiB, "M": MiB, "G": GiB, "T": TiB}
_SIZE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(I?B)?$", re.IGNORECASE)
_SHARE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*%$")
_DURATION = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*(s|m|h|d)?$", re.IGNORECASE)
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
FORMS = "bytes with a unit (48G, 512M, 1.5T), a share of RAM (80%), auto or off"


class MemoryLimitError(ValueError):
    """A memory limit that cannot be used; the message names the fix."""


@dataclass(frozen=True)
class LimitSpec:
    """What the user asked for, before it meets a machine."""

    kind: str  # "bytes" | "share" | "auto" | "off"
    value: float = 0.0  # bytes, or the share of RAM (0 < share <= 1)
    text: str = ""


def parse_memory_limit(text: Any) -> LimitSpec:
    """The spec in text; MemoryLimitError names what is wrong and the forms."""
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise MemoryLimitError(f"memory limit {text!r}: expected text; use {FORMS}")
    raw = str(text).strip()
    word = raw.lower()
    if word in ("auto", "off"):
        return LimitSpec(word, text=raw)
    share = _SHARE.match(raw)
    if share:
        percent = float(share.group(1))
        if not 0 < percent <= 100:
            raise MemoryLimitError(
                f"memory limit {raw!r}: a share of RAM must be above 0% and at most 100%")
        return LimitSpec("share", percent / 100.0, raw)
    size = _SIZE.match(raw)
    if size is None:
        unit = re.sub(r"^[\d.\s]+", "", raw)
        why = f"unknown unit {unit!r}" if unit and raw[:1].isdigit() else "not a size"
        raise MemoryLimitError(f"memory limit {raw!r}: {why}; use {FORMS}")
    number, unit = float(size.group(1)), size.group(2).upper()
    value = int(number * _UNITS[unit])
    if value < MiB:
        raise MemoryLimitError(
            f"memory limit {raw!r} is {value} bytes, less than 1 MiB: did you mean "
            f"{size.group(1)}G? Use {FORMS}")
    return LimitSpec("bytes", float(value), raw)


def parse_duration(text: Any, what: str) -> float:
    """Seconds from a number or '90s', '30m', '6h', '1d'; ValueError names what."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        match = _DURATION.match(str(text).strip())
        if match is None:
            raise ValueError(f"{what} {text!r}: expected seconds or a duration such as "
                             "90s, 30m, 6h")
        seconds = float(match.group(1)) * _DURATION_UNITS[(match.group(2) or "").lower()]
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{what} {text!r}: must be a positive duration, such as 30m or 6h")
    return seconds


@dataclass(frozen=True)
class Machine:
    """What ``auto`` needs to know about the machine (macos.machine() reads it)."""

    system: str  # sys.platform: "darwin", "linux", ...
    ram_bytes: Optional[int] = None
    gpu_wired_limit_bytes: Optional[int] = None  # iogpu.wired_limit_mb, when set (> 0)
    recommended_working_set: Optional[int] = None  # MLX's max_recommended_working_set_size


@dataclass(frozen=True)
class MemoryLimit:
    bytes: Optional[int]  # None: no limit, the guard is off
    reason: str  # how it was worked out, for the log and `status`


def reserve_for(ram_bytes: int) -> int:
    return SMALL_RESERVE_BYTES if ram_bytes < SMALL_RAM_BYTES else RESERVE_BYTES


def resolve_limit(spec: LimitSpec, machine: Machine) -> MemoryLimit:
    """The limit in bytes on this machine, or None (off), with how it was found."""
    if spec.kind == "off":
        return MemoryLimit(None, "memory guard off (memory_limit = off)")
    if spec.kind == "bytes":
        return MemoryLimit(int(spec.value), f"memory limit {format_bytes(int(spec.value))}")
    if spec.kind == "share":
        if not machine.ram_bytes:
            raise MemoryLimitError(
                f"memory limit {spec.text!r}: the size of this machine's RAM is unknown; "
                "give bytes instead (for example 48G)")
        limit = int(machine.ram_bytes * spec.value)
        return MemoryLimit(limit, f"memory limit {format_bytes(limit)} ({spec.text} of "
                                  f"{format_bytes(machine.ram_bytes)} RAM)")
    return _auto(machine)


def _auto(machine: Machine) -> MemoryLimit:
    if machine.system != "darwin":
        return MemoryLimit(None, "memory guard off: memory_limit = auto is off except on macOS "
                                 "(give bytes, such as --memory-limit 48G, to guard here)")
    if not machine.ram_bytes:
        return MemoryLimit(None, "memory guard off: the size of this Mac's RAM is unknown "
                                 "(give bytes, such as --memory-limit 48G)")
    reserve = reserve_for(machine.ram_bytes)
    candidates = [(machine.ram_bytes - reserve,
                   f"RAM {format_bytes(machine.ram_bytes)} minus {format_bytes(reserve)}")]
    if machine.gpu_wired_limit_bytes:
        candidates.append((machine.gpu_wired_limit_bytes, "the GPU wired cap (iogpu.wired_limit_mb)"))
    elif machine.recommended_working_set:
        candidates.append((machine.recommended_working_set,
                           "MLX's recommended working set"))
    limit, why = min(candidates)
    if limit <= 0:
        return MemoryLimit(None, f"memory guard off: {why} leaves nothing to serve in")
    return MemoryLimit(limit, f"memory limit {format_bytes(limit)} (auto: {why})")


def format_bytes(value: int) -> str:
    for unit, size in (("T", TiB), ("G", GiB), ("M", MiB), ("K", KiB)):
        if abs(value) >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value}B"


# -- the shim's memory, and the measure ---------------------------------------------

_FIELDS = ("rss", "phys_footprint", "mlx_active", "mlx_cache", "mlx_peak",
           "prompt_cache_bytes", "prompt_cache_entries")


@dataclass(frozen=True)
class HeartbeatMemory:
    """The heartbeat's ``memory`` object; None where the shim had no value."""

    rss: Optional[int] = None
    phys_footprint: Optional[int] = None
    mlx_active: Optional[int] = None
    mlx_cache: Optional[int] = None
    mlx_peak: Optional[int] = None
    prompt_cache_bytes: Optional[int] = None
    prompt_cache_entries: Optional[int] = None
    trimmed_request: Optional[int] = None  # the trim request last served, if any
    trimmed_bytes: Optional[int] = None  # what it freed (prompt cache + MLX cache)


def parse_heartbeat_memory(value: Any) -> Optional[HeartbeatMemory]:
    """The validated memory object (anything but a non-negative int is left
    out), or None when there is none."""
    if not isinstance(value, Mapping):
        return None
    fields = {name: value.get(name) for name in _FIELDS}
    clean = {name: v for name, v in fields.items() if _count(v)}
    trimmed = value.get("trimmed")
    if isinstance(trimmed, Mapping) and _count(trimmed.get("request")):
        clean["trimmed_request"] = trimmed["request"]
        freed = [trimmed.get(k) for k in ("prompt_cache_bytes", "mlx_cache_bytes")]
        if any(_count(v) for v in freed):
            clean["trimmed_bytes"] = sum(v for v in freed if _count(v))
    return HeartbeatMemory(**clean)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class Measure:
    bytes: int
    source: str  # which number it is, for the log and `status`


def measure(*, footprint: Optional[int] = None, heartbeat: Optional[HeartbeatMemory] = None,
            tree_rss: Optional[int] = None) -> Optional[Measure]:
    """The memory judged: phys_footprint where known (the watchdog's own read,
    else the heartbeat's), else the RSS of the process tree, else the
    heartbeat's RSS; never less than mlx_active. None when nothing is known."""
    beat = heartbeat or HeartbeatMemory()
    known = [(value, source) for value, source in (
        (footprint, "phys_footprint"), (beat.phys_footprint, "phys_footprint (heartbeat)"),
        (tree_rss, "RSS of the process tree"), (beat.rss, "RSS (heartbeat)"))
        if value is not None]
    value, source = known[0] if known else (None, "")
    if beat.mlx_active is not None and (value is None or beat.mlx_active > value):
        value, source = beat.mlx_active, "mlx_active (heartbeat)"
    return None if value is None else Measure(int(value), source)


def tree_rss(pid: int) -> Optional[int]:
    """RSS of process pid and all its descendants (psutil); None if it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root] + root.children(recursive=True)
    except psutil.Error:
        return None
    total, seen = 0, False
    for process in processes:
        try:
            total += process.memory_info().rss
            seen = True
        except psutil.Error:  # a child that just ended, or not ours to read
            continue
    return total if seen else None


# -- the request file -------------------------------------------------------------------


def request_path(heartbeat_file: "str | os.PathLike[str]") -> str:
    return os.fspath(heartbeat_file) + REQUEST_SUFFIX


def write_request(heartbeat_file: "str | os.PathLike[str]", *, pid: int,
                  trim: Optional[int] = None, soft_until: Optional[float] = None) -> str:
    """Ask the shim of process pid for a trim (a new number) and/or /health
    503 "memory" until soft_until (unix time). Written whole or not at all,
    readable by the server's user (0644). Returns the path."""
    request: dict = {"pid": int(pid)}
    if trim is not None:
        request["trim"] = int(trim)
    if soft_until is not None:
        request["soft_until"] = round(float(soft_until), 3)
    path = request_path(heartbeat_file)
    write_atomically(path, json.dumps(request) + "\n", mode=0o644)
    return path


def clear_request(heartbeat_file: "str | os.PathLike[str]") -> None:
    """Remove the request file (a new server process, or the guard off)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(request_path(heartbeat_file))
