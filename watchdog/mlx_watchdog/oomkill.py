"""Evidence: did the Linux kernel's OOM killer kill this pid?

A process SIGKILLed by the OOM killer leaves no report and no stderr; the
kernel's log says who it was (Linux mm/oom_kill.c):

    oom-kill:constraint=CONSTRAINT_NONE,...,task=python3,pid=4242,uid=501
    Out of memory: Killed process 4242 (python3) total-vm:...kB, anon-rss:...kB, ...
    Memory cgroup out of memory: Killed process 4242 (python3) ...   (a cgroup limit)
    Killed process 4242 (python) total-vm:...   (kernels before 5.x, after
                                                 "Out of memory: Kill process ... or sacrifice child")

The texts are the ``killed`` signature's (mlx_hotfix/signatures.py). Where to
read them: /dev/kmsg when readable, else ``dmesg`` (the same ring buffer,
both need CAP_SYSLOG where kernel.dmesg_restrict=1), else ``journalctl -k``
(the systemd-journal or adm group). Any that cannot be read is skipped:
find_oom_kill returns None, never raises. macOS has no OOM killer (jetsam is
its own class, from JetsamEvent reports).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

_TIMEOUT_S = 5.0
_MAX_RECORDS = 200_000  # /dev/kmsg keeps the ring buffer; enough for any of it


@dataclass(frozen=True)
class OomKill:
    pid: int
    process: str
    anon_rss_kb: Optional[int]  # the victim's anonymous memory when killed
    total_vm_kb: Optional[int]
    cgroup: bool  # a memory cgroup's limit (a container or a unit's MemoryMax), not the machine
    constraint: Optional[str]  # CONSTRAINT_NONE, CONSTRAINT_MEMCG, ...
    source: str  # where it was read: /dev/kmsg, dmesg, journalctl -k
    line: str

    def as_detail(self) -> dict:
        """For a death's detail (class ``killed``): what is known."""
        detail = {"by": "oom-killer", "pid": self.pid, "process": self.process,
                  "cgroup": self.cgroup, "kernel_log": self.source}
        for key in ("anon_rss_kb", "total_vm_kb", "constraint"):
            if getattr(self, key) is not None:
                detail[key] = getattr(self, key)
        return detail


def parse_oom_kill(pid: int, lines: Iterable[str], source: str = "") -> Optional[OomKill]:
    """The kernel's last OOM kill of pid in these log lines, or None. Pure."""
    from .signatures import entry

    killed = entry("killed")
    victim = None  # the "Killed process" record
    constraint = None
    for line in lines:
        found = killed.search(line)
        if found is None or found.groupdict().get("pid") != str(pid):
            continue
        groups = found.groupdict()
        if groups.get("constraint"):
            constraint = groups["constraint"]  # the summary comes before the kill
            victim = None
            continue
        victim = (line.rstrip("\n"), groups, constraint)
    if victim is None:
        return None
    line, groups, constraint = victim
    return OomKill(pid=pid, process=groups.get("process") or "",
                   anon_rss_kb=_kb(groups.get("anon_rss_kb")),
                   total_vm_kb=_kb(groups.get("total_vm_kb")),
                   cgroup="Memory cgroup out of memory" in line or constraint == "CONSTRAINT_MEMCG",
                   constraint=constraint, source=source, line=line)


def _kb(value: Optional[str]) -> Optional[int]:
    return int(value.replace(",", "")) if value else None


# -- reading the kernel's log ---------------------------------------------------


def read_kmsg(path: str = "/dev/kmsg") -> List[str]:
    """Every record in the kernel's ring buffer, one string each (raises OSError
    when it cannot be read)."""
    records: List[str] = []
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        while len(records) < _MAX_RECORDS:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break  # the end of the buffer
            except BrokenPipeError:
                continue  # records overwritten while reading: go on from the next
            if not record:
                break
            records.append(record.decode("utf-8", "replace"))
    finally:
        os.close(fd)
    return records


def _run(argv: Sequence[str]) -> List[str]:
    result = subprocess.run(list(argv), capture_output=True, text=True, errors="replace",
                            timeout=_TIMEOUT_S, check=False)
    if result.returncode != 0:
        raise OSError(f"{argv[0]} exited {result.returncode}: {result.stderr.strip()[:200]}")
    return result.stdout.splitlines()


Reader = Callable[[], Iterable[str]]

SOURCES: Tuple[Tuple[str, Reader], ...] = (
    ("/dev/kmsg", read_kmsg),
    ("dmesg", lambda: _run(["dmesg"])),
    ("journalctl -k", lambda: _run(["journalctl", "-k", "-b", "--no-pager", "-q", "-o", "short",
                                    "-n", "20000"])),
)


def find_oom_kill(pid: int, sources: Sequence[Tuple[str, Reader]] = SOURCES) -> Optional[OomKill]:
    """The OOM killer's record of pid from the kernel's log, or None (not
    found, or no log readable here). Never raises. The journal is read too
    when the ring buffer has nothing: it keeps what the buffer overwrote."""
    for name, read in sources:
        try:
            found = parse_oom_kill(pid, read(), name)
        except Exception:  # noqa: BLE001 - not readable here, or not parsable: the next
            continue
        if found is not None:
            return found
    return None
