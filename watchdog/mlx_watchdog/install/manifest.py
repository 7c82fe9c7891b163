"""The install manifest: what install wrote, so that uninstall removes exactly
that, and the marker check that keeps both off files they did not write.

Reads files (manifests, the head of a definition); writes none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional

from .instance import MARKER, Layout


@dataclass
class Manifest:
    manager: str
    name: str
    system: bool
    host: str
    port: int
    files: List[str]
    services: List[str]
    dry_run: bool = False

    def to_json(self) -> str:
        data = {
            "comment": f"{MARKER}: the files below are removed by `mlx-watchdog uninstall`.",
            "manager": self.manager,
            "name": self.name,
            "system": self.system,
            "host": self.host,
            "port": self.port,
            "files": self.files,
            "services": self.services,
            "dry_run": self.dry_run,
        }
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def load(cls, path: Path) -> Optional["Manifest"]:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or MARKER not in str(data.get("comment", "")):
            return None
        try:
            return cls(
                manager=str(data["manager"]),
                name=str(data["name"]),
                system=bool(data.get("system", False)),
                host=str(data.get("host", "")),
                port=int(data.get("port", 0)),
                files=[str(f) for f in data.get("files", [])],
                services=[str(s) for s in data.get("services", [])],
                dry_run=bool(data.get("dry_run", False)),
            )
        except (KeyError, TypeError, ValueError):
            return None


def is_ours(path: Path) -> bool:
    """True if the file at path carries the installer's marker."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError:
        return False
    return MARKER.encode() in head


def _installed(layout: Layout) -> Iterator[Manifest]:
    """The manifests in layout's config folder, by file name."""
    try:
        entries = sorted(layout.config_dir.glob("*.install.json"))
    except OSError:
        return
    for entry in entries:
        manifest = Manifest.load(entry)
        if manifest is not None:
            yield manifest


def installed_names(layout: Layout) -> List[str]:
    return [manifest.name for manifest in _installed(layout)]


def other_instances_on_port(layout: Layout, name: str, port: int) -> List[str]:
    """Names of other installed instances (by manifest) that use this port."""
    return [m.name for m in _installed(layout)
            if m.name != name and m.port == port and not m.dry_run]
