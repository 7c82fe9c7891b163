"""Crash reports appearing in a folder, counted for one instance (the
watchdog's restart evidence and `status`'s newest report)."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple

from . import contract
from .safefile import read_regular


@dataclass
class ReportScan:
    new: int  # reports that appeared since the previous scan
    newest: Optional[str] = None  # file name of the newest report
    newest_time: Optional[float] = None  # its mtime


class ReportWatcher:
    """Counts crash reports (report names: contract.REPORT_NAME) appearing in
    a folder: those of one instance when `instance` is given (several
    instances may share a folder).

    A report names its instance (`instance`: name, port, model; see
    reports.instance_field and the shim's reports.instance()): it is ours
    when its name is ours, or, without a name, when its port is ours. A
    report that names no instance at all is counted only when no instance
    is given. Reports already there when the watchdog starts are not new;
    the newest one is still shown by `status`.
    """

    def __init__(self, folder: "str | os.PathLike[str]", instance: Optional[str] = None,
                 port: Optional[int] = None):
        self.folder = Path(folder)
        self.instance = instance
        self.port = port
        self._seen: Optional[set] = None
        self._ours: Dict[str, bool] = {}  # file name -> is it this instance's
        self.newest: Optional[Tuple[float, str]] = None

    def scan(self) -> ReportScan:
        names = {}
        try:
            with os.scandir(self.folder) as entries:
                for entry in entries:
                    if contract.REPORT_NAME.match(entry.name):
                        with contextlib.suppress(OSError):
                            names[entry.name] = entry.stat().st_mtime
        except OSError:  # no folder (yet): no reports
            pass
        names = {name: mtime for name, mtime in names.items() if self._is_ours(name)}
        new = 0 if self._seen is None else len(set(names) - self._seen)
        self._seen = set(names) if self._seen is None else self._seen | set(names)
        if names:
            name = max(names, key=lambda n: (names[n], n))
            self.newest = (names[name], name)
        newest_time, newest = self.newest if self.newest else (None, None)
        return ReportScan(new=new, newest=newest, newest_time=newest_time)

    def _is_ours(self, name: str) -> bool:
        if self.instance is None:
            return True
        if name not in self._ours:  # each file is read once
            self._ours[name] = belongs_to(_read_report(self.folder / name), self.instance,
                                          self.port)
        return self._ours[name]


def belongs_to(report: Optional[Mapping[str, object]], name: str,
               port: Optional[int] = None) -> bool:
    """Whether a report is instance name's (see ReportWatcher)."""
    if not isinstance(report, Mapping):
        return False
    instance = report.get("instance")
    if isinstance(instance, str):  # the watchdog's own reports before schema 1 had a name only
        return instance == name
    if not isinstance(instance, Mapping):
        return False
    if instance.get("name") is not None:
        return instance.get("name") == name
    return port is not None and instance.get("port") == port


def _read_report(path: Path) -> Optional[Dict[str, object]]:
    try:
        data = json.loads(read_regular(path, 1 << 23))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
